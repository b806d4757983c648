"""SmolLM2-135M before and after SBD fine-tuning on standard-library Python (issue 3, part 6).

1. **train**: SBD fine-tuning (`fastforward.training.objectives.SBD`, which adds the `<|mask|>` token) of the
   model on the `pycode` task's train-split files as plain text, packed into `--seq-len` rows. The run
   directory under `--work` is named after the settings: a finished run is reused, a killed one resumes.
2. **evaluate**, on `pycode` (test split, next line, raw text) and `humaneval` (pass@1, chat template),
   the original model and the SBD model, each with our greedy AR, transformers' `generate`
   (`hf-generate`) and SBD decoding (entropy-bounded, block `--block-size`) at each of `--gammas`,
   interleaved example by example (`fastforward.evaluation.evaluate.compare`): accuracy, TPF, TPS, speedup over
   our AR and over `hf-generate` measured in the same run, and agreement (identical outputs, token
   match rate) with the *original* model's greedy AR output. The original model gets an untrained
   mask token (it never changes its greedy output), so its SBD rows show SBD decoding without SBD
   training.

    python benchmarks/smollm2_sbd.py                                   # the default budget: hours on CPU
    python benchmarks/smollm2_sbd.py --steps 2000 --batch-size 8 --mixed-precision bf16   # on a GPU
    python benchmarks/smollm2_sbd.py --steps 3 --seq-len 128 --batch-size 1 --n 3 --humaneval-n 2 \\
        --pycode-max-new-tokens 16 --humaneval-max-new-tokens 32 --threads 1   # smoke run (figures meaningless)

Prints a table per task and writes benchmarks/results/smollm2_sbd.json (machine, load averages,
training figures, every row) and per-example records to `--work`/records-<task>.jsonl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from common import HFGenerate, load_average, log, machine_info, set_threads

from fastforward.api import build_decoder
from fastforward.decoding.decoders import Decoder
from fastforward.decoding.metrics import token_agreement
from fastforward.demo.pipeline import pack_records
from fastforward.errors import FastForwardError
from fastforward.evaluation.evaluate import AR, compare
from fastforward.evaluation.report import format_table, write_json, write_records
from fastforward.evaluation.results import EvalResult
from fastforward.model import Model, load_model
from fastforward.tasks import PyCodeTask, get_task
from fastforward.training.objectives import SBD
from fastforward.training.run_dir import RESUME_NEUTRAL, latest_checkpoint
from fastforward.training.trainer import TrainConfig, train

HF = "hf-generate"


# ---- training ---------------------------------------------------------------------------------------
def train_sbd(args: argparse.Namespace) -> dict[str, Any]:
    """Train (or reuse, or resume) the SBD model; returns its directory and the training figures."""
    config = TrainConfig(
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=max(1, min(30, args.steps // 10)),
        seed=args.seed,
        mixed_precision=args.mixed_precision,
        eval_every=0,
        save_every=args.save_every,
        keep_checkpoints=1,
    )
    objective = SBD()
    # about one epoch of the budget in ≤ 4000-character chunks (≈ 800 tokens each, short file tails included)
    texts = args.train_texts or max(8, -(-args.steps * args.batch_size * args.seq_len // 800))
    settings = {
        "model": args.model,
        "train_texts": texts,
        "objective": objective.describe(),
        "train": {k: v for k, v in asdict(config).items() if k not in RESUME_NEUTRAL},
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    run = Path(args.work) / f"sbd-{digest}"
    seconds, before = 0.0, config.steps  # steps done before this run
    if (run / "config.json").exists():
        log(f"reusing the finished SBD run {run}")
    else:
        model = load_model(args.model)
        records = PyCodeTask().text_records(texts, seed=args.seed)
        data = pack_records(model, records, args.seq_len)
        log(f"SBD fine-tuning {args.model}: {len(records)} stdlib chunks = {len(data)} rows of {args.seq_len} → {run}")
        checkpoint = latest_checkpoint(run)
        before = json.loads((checkpoint / "trainer_state.json").read_text())["step"] if checkpoint else 0
        started = time.perf_counter()
        try:
            train(model, objective, data, config, run)
        except FastForwardError as exc:  # a leftover run the settings hash did not tell apart (e.g. new data)
            log(f"starting {run} afresh: {exc}")
            before = 0
            train(model, objective, data, config, run, overwrite=True)
        seconds = time.perf_counter() - started
    steps = read_metrics(run)
    ends = {"first": steps[:10], "last": steps[-10:]}
    return {
        "dir": str(run),
        "settings": settings,
        "steps_this_run": len(steps) - before,
        "seconds_this_run": round(seconds, 1),
        "seconds_per_step": round(statistics.median(s["tokens"] / s["tokens_per_s"] for s in steps), 3),
        "tokens_per_step": steps[-1]["tokens"],
        **{
            f"{key}_{end}10": round(statistics.mean(s[key] for s in rows), 4)
            for end, rows in ends.items()
            for key in ("loss", "mask_loss", "ntp_loss")
        },
    }


def read_metrics(run: Path) -> list[dict]:
    """The training steps logged in a run's metrics.jsonl (none when it has not started)."""
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if r.get("split") == "train"]


# ---- evaluation -------------------------------------------------------------------------------------
def evaluate_task(
    name: str, n: int, max_new_tokens: int, models: dict[str, Model], args: argparse.Namespace
) -> dict[str, Any]:
    """Every model × decoder on one task, the first model's greedy AR output being the reference."""
    task = get_task(name)
    chat = name != "pycode"  # pycode continues raw code; humaneval asks the instruct model
    budget = max_new_tokens or task.max_new_tokens
    examples = task.examples("test", n, seed=args.seed)
    reference: list[list[int]] | None = None
    rows: list[dict[str, Any]] = []
    loads: dict[str, list] = {}
    results: list[EvalResult] = []
    for model_name, model in models.items():
        decoders: dict[str, Decoder] = {HF: HFGenerate()}
        for gamma in args.gammas:
            sbd = build_decoder(
                "sbd",
                block_size=args.block_size,
                policy="entropy",
                gamma=gamma,
                first_token_from_ntp=args.first_token_from_ntp,
            )
            decoders[f"sbd γ={gamma:g}"] = sbd
        load = load_average()
        got = compare(model, task, decoders, examples, max_new_tokens=budget, chat_template=chat, desc=model_name)
        loads[model_name] = [load, load_average()]
        ids = {label: [r["token_ids"] for r in result.records] for label, result in got.items()}
        reference = reference or ids[AR]
        for label, result in got.items():
            agreement = [token_agreement(a, b) for a, b in zip(ids[label], reference, strict=True)]
            for record, (same, rate) in zip(result.records, agreement, strict=True):
                record.update(model=model_name, same_as_original_ar=same, original_ar_token_match=round(rate, 4))
            rows.append(
                {
                    "model": model_name,
                    "decoder": label,
                    "accuracy": round(result.accuracy, 2),
                    "tpf": round(result.tpf, 3),
                    "tps": round(result.tps, 2),
                    "speedup_vs_ar": round(result.speedup or 0.0, 3),
                    "speedup_vs_hf": round(result.tps / got[HF].tps, 3) if got[HF].tps else None,
                    "same_as_original_ar": round(100 * sum(s for s, _ in agreement) / len(agreement), 2),
                    "original_ar_token_match": round(statistics.mean(r for _, r in agreement), 4),
                    "summary": result.summary(),
                }
            )
        results.extend(got.values())
    records = write_records(Path(args.work) / f"records-{name}.jsonl", results)
    return {
        "task": task.describe(),
        "n": len(examples),
        "max_new_tokens": budget,
        "chat_template": chat,
        "load_average": loads,
        "records": str(records),
        "rows": rows,
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    return format_table(
        rows,
        [
            ("model", "model", str),
            ("decoder", "decoder", str),
            ("acc %", "accuracy", lambda x: f"{x:.1f}"),
            ("TPF", "tpf", lambda x: f"{x:.2f}"),
            ("TPS", "tps", lambda x: f"{x:.1f}"),
            ("vs AR", "speedup_vs_ar", lambda x: f"{x:.2f}x"),
            ("vs HF", "speedup_vs_hf", lambda x: f"{x:.2f}x"),
            ("= orig AR %", "same_as_original_ar", lambda x: f"{x:.1f}"),
            ("orig AR token match", "original_ar_token_match", lambda x: f"{x:.3f}"),
        ],
    )


# ---- the run ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="preset or model directory")
    ap.add_argument("--work", default="runs/bench-smollm2-sbd", help="training runs and per-example records")
    ap.add_argument("--out", default="benchmarks/results/smollm2_sbd.json")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the cores not busy)")
    ap.add_argument("--seed", type=int, default=0)
    # training
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no")
    ap.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps (a killed run resumes)")
    ap.add_argument("--train-texts", type=int, default=0, help="stdlib text chunks (0: about one epoch)")
    # evaluation
    ap.add_argument("--n", type=int, default=100, help="pycode test examples (0: skip)")
    ap.add_argument("--humaneval-n", type=int, default=10, help="HumanEval problems (0: skip)")
    ap.add_argument("--pycode-max-new-tokens", type=int, default=0, help="0: the task's budget (40)")
    ap.add_argument("--humaneval-max-new-tokens", type=int, default=0, help="0: the task's budget (512)")
    ap.add_argument("--dtype", default="float32", help="evaluation dtype")
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.1, 0.6], help="SBD γ (entropy bound)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--first-token-from-ntp", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    started = time.perf_counter()
    load_start = load_average()
    log(f"load average at start: {load_start} ({torch.get_num_threads()} torch threads)")
    training = train_sbd(args)
    trained = time.perf_counter()
    log(f"training: {training['seconds_per_step']} s per step; last loss {training['loss_last10']}")
    models = {
        "original": load_model(args.model, dtype=args.dtype),
        "sbd": load_model(training["dir"], dtype=args.dtype),
    }
    models["original"].add_mask_token()  # untrained: lets SBD decoding run; greedy AR never picks it
    tasks = {
        name: evaluate_task(name, n, budget, models, args)
        for name, n, budget in (
            ("pycode", args.n, args.pycode_max_new_tokens),
            ("humaneval", args.humaneval_n, args.humaneval_max_new_tokens),
        )
        if n > 0
    }
    result = {
        "model": args.model,
        "args": vars(args),
        "machine": {**machine_info(), "load_average_start": load_start, "load_average_end": load_average()},
        "training": training,
        "tasks": tasks,
        "seconds": {"train": round(trained - started, 1), "evaluate": round(time.perf_counter() - trained, 1)},
    }
    write_json(args.out, result)
    for name, task in tasks.items():
        log(f"\n{name}: {task['n']} test examples, ≤ {task['max_new_tokens']} new tokens, {args.dtype}, batch 1")
        log(format_rows(task["rows"]))
    log(f"\nTPS ratios are within one model's interleaved run; load average {result['machine']['load_average_end']}")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
