"""The output layer's loss alone: whole logits against `fastforward.model.head`'s chunks, and where a step's
time goes (torch's profiler) with each.

Part 1 (default): a cross entropy with its gradients over `--rows` hidden rows through SmolLM2's output layer
(V = 49,152, H = 576, random weights; its cost does not depend on their values), and the Jacobi Forcing pair
(cross entropy plus distillation of half as many student rows), from whole float32 logits (the trainer before)
and chunk by chunk at each `--chunks` size (rows of logits a chunk), best of 3 after one untimed call.

Part 2 (`--profile`): one SBD LoRA step of SmolLM2-135M (float32, 8 rows of 256 `pycode` tokens) under torch's
profiler, before (whole logits) and now; the ops that take the most time, and the step's total.

    python benchmarks/head_loss.py                   # about 1 min
    . benchmarks/avx2_env.sh && python benchmarks/head_loss.py
    python benchmarks/head_loss.py --profile         # about 2 min more
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch
import torch.nn.functional as F
from common import RESULTS, load_average, log, set_threads, write_report

from fastforward.model import Model, head, load_model
from fastforward.tasks import get_task
from fastforward.training import lora
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import make_objective

VOCAB, WIDTH = 49152, 576


def best_of(call, repeats: int = 3) -> float:
    call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return min(times)


def loss_times(rows: int, chunks: list[int]) -> dict:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, WIDTH, generator=g).requires_grad_(True)
    weight = torch.randn(VOCAB, WIDTH, generator=g) * 0.02
    targets = torch.randint(0, VOCAB, (rows,), generator=g)
    students = torch.randn(rows // 2, WIDTH, generator=g).requires_grad_(True)
    teacher = torch.randint(0, rows, (rows // 2,), generator=g)

    def whole() -> None:
        F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum").backward()

    def whole_pair() -> None:
        clean = F.log_softmax(F.linear(hidden, weight), dim=-1)
        student = F.log_softmax(F.linear(students, weight), dim=-1)
        kl = F.kl_div(student, clean[teacher].detach(), log_target=True, reduction="sum")
        (F.nll_loss(clean, targets, reduction="sum") + kl).backward()

    def chunked() -> None:
        head.cross_entropy(head.HeadRows(hidden, weight), targets).backward()

    def chunked_pair() -> None:
        rows_, student = head.HeadRows(hidden, weight), head.HeadRows(students, weight)
        sum(head.cross_entropy_and_distillation(rows_, targets, student, teacher)).backward()

    out = {"whole": {"cross_entropy": best_of(whole), "pair": best_of(whole_pair)}}
    for chunk in chunks:
        with mock.patch.object(head, "CHUNK_FLOATS", chunk * VOCAB):
            out[f"chunks of {chunk}"] = {"cross_entropy": best_of(chunked), "pair": best_of(chunked_pair)}
    for name, times in out.items():
        log(f"{name}: cross entropy {times['cross_entropy']:.3f} s, with distillation {times['pair']:.3f} s")
    return out


def profile_step(whole_logits: bool) -> dict:
    """One SBD LoRA step's total and its costliest ops (seconds), after an untimed step."""
    from torch.profiler import ProfilerActivity, profile

    with mock.patch.object(Model, "plain_head", None) if whole_logits else contextlib.nullcontext():
        model = load_model("smollm2-135m")
        objective = make_objective("sbd")
        objective.setup(model)
        records = get_task("pycode").training_records(200, seed=0)
        examples = [encode_record({"text": r["prompt"] + r["completion"]}, model.tokenizer) for r in records]
        data = PackedData(examples, 256, model.pad_token_id)
        lora.wrap(model, 16, 0, "all-linear", 0)
        model.hf.train()

        def step(i: int) -> None:
            loss, _ = objective.loss(model, data.batch(i, 8, 0), torch.Generator().manual_seed(i))
            loss.backward()

        step(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(1)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    top = {e.key: round(e.self_cpu_time_total / 1e6, 3) for e in ops[:12]}
    log(f"{'before' if whole_logits else 'now'}: {total:.1f} s of CPU time in the step; " + listed(top))
    return {"total_s": round(total, 2), "ops": top}


def listed(ops: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in ops.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1800, help="hidden rows the loss reads")
    p.add_argument("--chunks", type=int, nargs="+", default=[42, 170, 341, 682, 1365], help="rows a chunk")
    p.add_argument("--profile", action="store_true", help="also profile one SBD step before and now")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=RESULTS / "head_loss.json")
    args = p.parse_args()
    threads = set_threads(args.threads)
    before = load_average()
    figures = {"rows": args.rows, "loss": loss_times(args.rows, args.chunks)}
    if args.profile:
        figures["profile"] = {"before": profile_step(True), "now": profile_step(False)}
    write_report(args.out, before, threads, **figures)


if __name__ == "__main__":
    main()
