"""The GPU check: what fastforward does on a CUDA GPU, in one command that prints tables and writes JSON.

    python benchmarks/gpu_check.py                        # on a CUDA GPU: about 6 minutes on an H100/H200
    python benchmarks/gpu_check.py --device cpu --smoke   # that it runs, at toy sizes, on any machine

Parts (--parts; each is timed, and its failure is recorded without stopping the others):
  tests     `pytest -m "not slow"` with the GPU visible: device-parametrised tests (tests/test_flex.py,
            tests/test_step_graphs.py)
            run their CUDA cases, the rest of the suite runs as on CI.
  train     training-step throughput (tokens/s, peak memory) of ntp, sbd, multitf and setdlm on
            SmolLM2-135M (fp32 master weights, bf16 autocast), dense SDPA masks against FlexAttention,
            and the first step's loss under each (the same batch and draws).
  decode    tokens/s, ms per step and tokens per forward of transformers' generate, ar, lookup and
            jacobi on SmolLM2-135M in bf16, and of ar and sbd-verified on the demo's SBD model
            (fp32), at batch 1 and 16, with CUDA graphs and without (SDPA; --decode-flex adds
            FlexAttention); whether each lossless decoder gave ar's tokens.
  roofline  block cost of a k-token forward against a 256-entry cache, k = 1 … 64, batch 1
            (`fastforward.evaluation.roofline.measure_block_cost`): SDPA with CUDA graphs and
            without, and FlexAttention.

JSON goes to --json after every part, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from common import CHAT, RESULTS, HFGenerate, log, machine_info

from fastforward.api import build_decoder
from fastforward.evaluation.roofline import measure_block_cost
from fastforward.model import Model, flex, load_model
from fastforward.training.data import Example, PackedData
from fastforward.training.objectives import make_objective

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "train", "decode", "roofline")
OBJECTIVES = ("ntp", "sbd", "multitf", "setdlm")
ATTENTIONS = ("sdpa", "flex")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    p.add_argument("--model", default="smollm2-135m", help="the model of the train, decode and roofline parts")
    p.add_argument("--sbd-model", default="demo-sbd", help="a model trained with SBD, for sbd-verified")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--smoke", action="store_true", help="toy sizes: that every part runs, not figures")
    p.add_argument("--json", type=Path, default=RESULTS / "gpu_check.json")
    p.add_argument("--log-dir", type=Path, default=None, help="where the test part's full log goes")
    p.add_argument("--tests-timeout", type=float, default=240, help="seconds the test part may take")
    p.add_argument("--deadline", type=float, default=None, help="seconds from start by which the test part ends")
    p.add_argument("--decode-flex", action="store_true", help="decode under FlexAttention too (ar only)")
    p.add_argument("--report", type=Path, default=None, help="print the tables of an earlier run's JSON, run nothing")
    args = p.parse_args()
    if args.report:
        print_tables(json.loads(args.report.read_text()))
        return 0
    sizes = SMOKE if args.smoke else FULL
    started_all = time.perf_counter()
    record: dict = {"machine": machine_info(load=True) | _gpu_info(args.device), "sizes": sizes, "parts": {}}
    for part in args.parts:
        started = time.perf_counter()
        if args.deadline is not None:  # what is left of the deadline, less a margin for the tables
            args.tests_timeout = min(args.tests_timeout, args.deadline - (started - started_all) - 20)
        log(f"== {part}")
        try:
            result = RUNNERS[part](args, sizes)
        except Exception as exc:  # one part's failure must not lose the others' figures
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - started, 1)
        record["parts"][part] = result
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
        log(f"== {part}: {result['seconds']} s")
    record["targets"] = targets(record["parts"])
    args.json.write_text(json.dumps(record, indent=1))
    print_tables(record)
    log(f"wrote {args.json}")
    return 0


FULL = {"seq_len": 2048, "batch": 8, "train_steps": 5, "new_tokens": 128, "prompts": 4, "repeats": 10}
SMOKE = {"seq_len": 64, "batch": 2, "train_steps": 1, "new_tokens": 8, "prompts": 2, "repeats": 1}


def _gpu_info(device: str) -> dict:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return {"gpu": None}
    return {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}


def _guarded(labels: dict, measure) -> dict:
    """labels | measure(), or labels | the error: one configuration's failure must not lose the others."""
    try:
        row = labels | measure()
    except Exception as exc:
        traceback.print_exc()
        row = labels | {"error": f"{type(exc).__name__}: {exc}"[:500]}
    log(json.dumps(row))
    return row


def _json(record: dict) -> dict:
    """`record` as its JSON file will hold it (integer keys become strings), so that a run's own tables
    and targets read it as `--report` reads the file."""
    return json.loads(json.dumps(record))


def _graphs() -> int:
    """Graphs torch.compile has built in this process so far (FlexAttention's kernels, on CUDA)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- tests --------------------------------------------------------------------------------------
def run_tests(args: argparse.Namespace, sizes: dict) -> dict:
    # -v: a test's outcome is on its own line as it ends, so a run stopped by --tests-timeout still names them
    command = [sys.executable, "-m", "pytest", "-v", "-m", "not slow", "-p", "no:cacheprovider"]
    if args.smoke:
        command += ["tests/test_flex.py", "tests/test_step_graphs.py"]  # the device-parametrised tests
    elif importlib.util.find_spec("xdist"):
        command += ["-n", str(min(8, os.cpu_count() or 1))]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_timeout)
        output, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        output = partial + f"\nstopped after {args.tests_timeout} s (--tests-timeout)"
        returncode = None
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        (args.log_dir / "pytest.log").write_text(output)
    outcomes = re.findall(
        r"(PASSED|FAILED|SKIPPED|ERROR)\s+(tests/\S+)|(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR)", output
    )
    named = {(test or test2): (kind or kind2) for kind, test, test2, kind2 in outcomes}
    # "errors", not "error": that key marks a part that failed
    kinds = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors"}
    counts = {name: sum(1 for k in named.values() if k == kind) for kind, name in kinds.items()}
    failed = sorted(f"{kind} {test}" for test, kind in named.items() if kind in ("FAILED", "ERROR"))
    return {"command": " ".join(command[1:]), "returncode": returncode, **counts, "failures": failed[:40]}


# ---- train --------------------------------------------------------------------------------------
def random_data(model: Model, rows: int, seq_len: int) -> PackedData:
    """`rows` rows of random token ids, every token a target (the step's cost does not depend on the text)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.tokenizer.vocab_size
    examples = [Example(torch.randint(3, vocab, (seq_len,), generator=generator).tolist(), [True] * seq_len)]
    return PackedData(examples * rows, seq_len, model.pad_token_id)


def run_training(args: argparse.Namespace, sizes: dict) -> dict:
    device = torch.device(args.device)
    model = load_model(args.model, dtype="float32")
    model.add_mask_token()
    model.hf.to(device).train()
    initial = {k: v.detach().clone() for k, v in model.hf.state_dict().items()}
    data = random_data(model, sizes["batch"] * (sizes["train_steps"] + 1), sizes["seq_len"])
    rows = []
    for name in OBJECTIVES:
        for attention in ATTENTIONS:
            if attention == "flex" and device.type != "cuda":
                rows.append({"objective": name, "attention": attention, "skipped": "FlexAttention trains on CUDA only"})
                continue
            model.hf.load_state_dict(initial)
            model.hf.config._attn_implementation = flex.NAME if attention == "flex" else "sdpa"
            labels = {"objective": name, "attention": attention}
            rows.append(_guarded(labels, lambda: _train_steps(model, name, data, sizes, device)))  # noqa: B023
    for name in OBJECTIVES:  # loss agreement and speed-up, flex against sdpa
        dense, fused = (next(r for r in rows if r["objective"] == name and r["attention"] == a) for a in ATTENTIONS)
        if "tokens_per_s" in dense and "tokens_per_s" in fused:
            fused["speedup"] = round(fused["tokens_per_s"] / dense["tokens_per_s"], 2)
            fused["loss_difference"] = abs(fused["first_loss"] - dense["first_loss"])
    return {"rows": rows}


def _train_steps(model: Model, name: str, data: PackedData, sizes: dict, device: torch.device) -> dict:
    objective = make_objective(name)
    objective.setup(model)
    optimizer = torch.optim.AdamW(model.hf.parameters(), lr=1e-5, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(sizes["train_steps"] + 1):  # step 0 compiles (FlexAttention) and warms up
        batch = data.batch(step, sizes["batch"], seed=0).to(device)
        generator = torch.Generator().manual_seed(step)
        _sync(device)
        started = time.perf_counter()
        with autocast:
            loss, _ = objective.loss(model, batch, generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    timed = sum(times[1:])
    tokens = sizes["batch"] * sizes["seq_len"] * sizes["train_steps"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "graphs_compiled": _graphs(),
        "tokens_per_s": round(tokens / timed),
        "step_ms": round(1000 * timed / sizes["train_steps"], 1),
        "first_step_s": round(times[0], 2),
        "first_loss": losses[0],
        "peak_gib": None if peak is None else round(peak, 2),
    }


# ---- decode -------------------------------------------------------------------------------------
FIXED_STEP = 32  # the step length of the fixed-length variant: sbd-verified's verify forward (16 + 16) fits


def _variants(args: argparse.Namespace, decode: bool) -> list[tuple[str, bool, int | None]]:
    """(attention, CUDA graphs, fixed step length) to measure: SDPA with graphs and without on a GPU,
    and for decoding graphs at one step length (lossless decoders then give ar's tokens bit for bit,
    tests/test_step_graphs.py); FlexAttention for the block cost (and for decoding with --decode-flex:
    a new BlockMask per step is several times slower, docs/notes/2026-11-26-first-gpu-run.md)."""
    on_gpu = torch.device(args.device).type == "cuda"
    variants = [("sdpa", True, None), ("sdpa", False, None)] if on_gpu else [("sdpa", False, None)]
    if on_gpu and decode:
        variants.insert(1, ("sdpa", True, FIXED_STEP))
    return variants + ([("flex", False, None)] if args.decode_flex or not decode else [])


def _load(name: str, dtype: str, args: argparse.Namespace, attention: str, graphs: bool, step: int | None) -> Model:
    # With a step length the graphs are made below, not by load_model as well
    model = load_model(name, dtype=dtype, device=args.device, attention=attention, cuda_graphs=graphs and not step)
    if step is not None:
        model.use_step_graphs(step_length=step)
    return model


def run_decoding(args: argparse.Namespace, sizes: dict) -> dict:
    dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    rows = []
    for attention, graphs, step in _variants(args, decode=True):
        model = _load(args.model, dtype, args, attention, graphs, step)
        # Under FlexAttention only ar: what a BlockMask per step costs (every decoder pays it alike)
        names = ("ar", "lookup", "jacobi") if attention == "sdpa" else ("ar",)
        baseline = {"hf-generate": HFGenerate()} if attention == "sdpa" and not graphs else {}
        labels = {"attention": attention, "graphs": graphs} | ({"step_length": step} if step else {})
        rows += _decode_rows(model, baseline | {n: build_decoder(n) for n in names}, sizes, labels, dtype)
        sbd = _load(args.sbd_model, "float32", args, attention, graphs, step)
        names = ("ar", "sbd-verified") if attention == "sdpa" else ("ar",)
        rows += _decode_rows(sbd, {n: build_decoder(n) for n in names}, sizes, labels, "float32")
        del model, sbd
    return {"rows": rows}


def _decode_rows(model: Model, decoders: dict, sizes: dict, variant: dict, dtype: str) -> list[dict]:
    chat = [model.encode_prompt(p) for p in CHAT]
    rows = []
    for batch in (1, 16):
        prompts = (chat * 2)[:16] if batch == 16 else chat[: sizes["prompts"]]
        reference = None
        for name, decoder in decoders.items():
            if name == "hf-generate" and batch > 1:
                continue  # the baseline is batch 1
            labels = {"model": model.name, "dtype": dtype, **variant, "batch": batch, "decoder": name}
            row = _guarded(labels, lambda: _decode(model, decoder, prompts, batch, sizes["new_tokens"]))  # noqa: B023
            ids = row.pop("ids", None)
            if name == "ar":
                reference = ids
            elif reference is not None and ids is not None and name != "hf-generate":
                row["same_tokens_as_ar"] = ids == reference
            rows.append(row)
    return rows


def _decode(model: Model, decoder, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    decoder.generate(model, prompts[:batch], max_new_tokens=4)  # warm-up: kernels, compiled graphs
    graphs = _graphs()
    _sync(model.device)
    started = time.perf_counter()
    if batch == 1:
        generations = [g for prompt in prompts for g in decoder.generate(model, [prompt], new_tokens)]
    else:
        generations = decoder.generate(model, prompts, new_tokens)
    _sync(model.device)
    seconds = time.perf_counter() - started
    tokens = sum(len(g.token_ids) for g in generations)
    forwards = sum(g.stats.nfe for g in generations)
    steps = forwards if batch == 1 else max(g.stats.nfe for g in generations)  # a batch's rows share steps
    return {
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "step_ms": round(1000 * seconds / steps, 2) if steps else None,
        "tpf": round(tokens / forwards, 3) if forwards else None,
        "graphs_compiled_while_timed": _graphs() - graphs,
        "ids": [g.token_ids for g in generations],
    }


# ---- roofline -----------------------------------------------------------------------------------
def run_roofline(args: argparse.Namespace, sizes: dict) -> dict:
    dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    rows = []
    for attention, graphs, _ in _variants(args, decode=False):
        model = load_model(args.model, dtype=dtype, device=args.device, attention=attention, cuda_graphs=graphs)
        blocks = [1, 2, 4, 8, 16, 32, 64]
        rows.append(
            _guarded(
                {"attention": attention, "graphs": graphs},
                lambda: _json(measure_block_cost(model, blocks, cache_len=256, repeats=sizes["repeats"]).as_dict()),  # noqa: B023
            )
        )
    return {"rows": rows}


RUNNERS = {"tests": run_tests, "train": run_training, "decode": run_decoding, "roofline": run_roofline}


# ---- the targets of issue 40 ----------------------------------------------------------------------
def targets(parts: dict) -> list[dict]:
    """Each target with its measured value: FlexAttention's SBD training speed-up (>= 2) and loss agreement
    (<= 1e-3); our ar against transformers' generate at batch 1 (>= 1); each lossless decoder's wall-clock
    speed-up over ar as a share of its TPF (>= 0.8); block cost at k = 16 over k = 1 (<= 1.1)."""
    found = []

    def add(name: str, value: float | None, bound: float, above: bool) -> None:
        if value is not None:
            met = value >= bound if above else value <= bound
            found.append(
                {"target": name, "value": round(value, 4), "bound": f"{'>=' if above else '<='} {bound}"} | {"met": met}
            )

    for r in parts.get("train", {}).get("rows", []):
        if r["objective"] == "sbd" and "speedup" in r:
            add("sbd training: flex tokens/s over sdpa", r["speedup"], 2.0, True)
        if "loss_difference" in r:
            add(f"{r['objective']} training: |flex - sdpa| first loss", r["loss_difference"], 1e-3, False)
    rows = [r for r in parts.get("decode", {}).get("rows", []) if "tokens_per_s" in r and r["attention"] == "sdpa"]
    speed = {(r["model"], r["batch"], r["decoder"], graphs(r)): r for r in rows}
    for (model, batch, name, graphed), r in speed.items():
        ar = speed.get((model, batch, "ar", graphed))
        variant = {"on": "CUDA graphs", "off": "eager"}.get(graphed, f"CUDA graphs, {graphed}")
        baseline = speed.get((model, 1, "hf-generate", "off"))
        if name == "ar" and batch == 1 and baseline:
            add(
                f"{model} batch 1 ({variant}): ar over transformers' generate",
                r["tokens_per_s"] / baseline["tokens_per_s"],
                1.0,
                True,
            )
        if name in ("lookup", "jacobi", "sbd-verified") and ar and r["tpf"]:
            add(
                f"{model} batch {batch} ({variant}): {name} speed-up over ar / TPF",
                r["tokens_per_s"] / ar["tokens_per_s"] / r["tpf"],
                0.8,
                True,
            )
    for r in parts.get("roofline", {}).get("rows", []):
        if r.get("attention") == "sdpa" and "ratios" in r:
            variant = "CUDA graphs" if r.get("graphs") else "eager"
            add(f"block cost k=16 / k=1 (sdpa, {variant}, batch 1)", r["ratios"]["16"], 1.1, False)
    return found


# ---- the tables ---------------------------------------------------------------------------------
def graphs(row: dict) -> str:
    """The CUDA graphs column: on, on at a fixed step length, or off (also for a run recorded before
    graphs were built)."""
    if row.get("graphs") and row.get("step_length"):
        return f"steps of {row['step_length']}"
    return {True: "on", False: "off"}.get(row.get("graphs"), "off")


def print_tables(record: dict) -> None:
    machine = record["machine"]
    where = machine.get("gpu") or machine["processor"]
    print(f"\n{where}; torch {machine['torch']}, transformers {machine['transformers']}")
    parts = record["parts"]
    for name, part in parts.items():
        if "error" in part:
            print(f"\n{name}: FAILED: {part['error']}")
    if "tests" in parts and "error" not in parts["tests"]:
        t = parts["tests"]
        counts = ", ".join(f"{t[k]} {k}" for k in ("passed", "failed", "skipped", "errors") if k in t)
        print(f"\ntests: {counts} ({t['seconds']} s)")
        for line in t["failures"]:
            print(f"  {line}")
    if "rows" in parts.get("train", {}):
        print("\n| objective | attention | tokens/s | step ms | peak GiB | first loss | flex speed-up | loss diff |")
        print("|---|---|---|---|---|---|---|---|")
        for r in parts["train"]["rows"]:
            if "skipped" in r or "error" in r:
                why = r.get("skipped") or f"FAILED: {r['error']}"
                print(f"| {r['objective']} | {r['attention']} | {why} | | | | | |")
                continue
            diff = f"{r['loss_difference']:.1e}" if "loss_difference" in r else ""
            print(
                f"| {r['objective']} | {r['attention']} | {r['tokens_per_s']} | {r['step_ms']} | {r['peak_gib']} | "
                f"{r['first_loss']:.4f} | {r.get('speedup', '')} | {diff} |"
            )
    if "rows" in parts.get("decode", {}):
        print("\n| model | attention | graphs | batch | decoder | tokens/s | ms/step | TPF | = ar |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in parts["decode"]["rows"]:
            if "error" in r:
                where = f"{r['model']} ({r['dtype']}) | {r['attention']} | {graphs(r)} | {r['batch']} | {r['decoder']}"
                print(f"| {where} | FAILED: {r['error']} | | | |")
                continue
            same = {True: "yes", False: "NO"}.get(r.get("same_tokens_as_ar"), "")
            print(
                f"| {r['model']} ({r['dtype']}) | {r['attention']} | {graphs(r)} | {r['batch']} | {r['decoder']} | "
                f"{r['tokens_per_s']} | {r.get('step_ms', '')} | {r['tpf']} | {same} |"
            )
    found = record.get("targets") or targets(parts)
    if found:
        print("\n| target | measured | bound | met |\n|---|---|---|---|")
        for t in found:
            print(f"| {t['target']} | {t['value']} | {t['bound']} | {'yes' if t['met'] else 'NO'} |")
    if "rows" in parts.get("roofline", {}):
        for r in parts["roofline"]["rows"]:
            if "error" in r:
                print(f"\nblock cost ({r['attention']}, graphs {graphs(r)}): FAILED: {r['error']}")
                continue
            ratios = ", ".join(f"k={k}: {v:.3f}" for k, v in r["ratios"].items())
            k1 = 1000 * r["times"]["1"]
            print(f"\nblock cost / k=1 ({r['dtype']}, cache {r['cache_len']}; k=1 {k1:.2f} ms): {ratios}")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
