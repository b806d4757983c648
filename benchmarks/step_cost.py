"""Where a decoding step's time goes: the model's forward vs the decoder's own work around it.

Every forward of the decode loop is timed from outside (a wrapper around `Model.run`); the
decoder's own work is the decode time minus those forwards (prefill excluded), divided by the
forwards (NFE). Also prints each decoder's decode speed (generated tokens / wall seconds).

    python benchmarks/step_cost.py                          # demo-shaped model (random init), 1 thread
    python benchmarks/step_cost.py --model smollm2-135m --dtype bfloat16 --threads 2 --max-new-tokens 64
    python benchmarks/step_cost.py --model smollm2-135m --quantize int4 --exact --compile --threads 2 --decoders ar
    python benchmarks/step_cost.py --model smollm2-135m --against /tmp/before   # before/after, one run

`--against DIR` names a checkout of another commit: each repeat runs this script once on this tree
and once with DIR first on PYTHONPATH, alternately (A B A B ...), so a change of machine load hits
both alike; the table then shows both and the ratio of decode speeds. The decoder's own work
includes building each prompt's result (one detokenisation per prompt, spread over its steps).
Without a trained model the weights are random: the per-step split is what this measures, not the
tokens per forward. Writes benchmarks/results/step_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import HERE, RESULTS, load_average, machine_info

from fastforward import build_decoder, load_model
from fastforward.model import Model
from fastforward.model.tiny import tiny_model
from fastforward.tasks import get_task

DECODERS = {
    "ar": {},
    "sbd": {"block_size": 16, "gamma": 0.35},
    "sbd-verified": {"block_size": 16, "gamma": 0.1},
    "jacobi": {"block_size": 16},
    "jacobi-mr": {"block_size": 16},
}


def demo_shaped(prompts: list[str]) -> Model:
    """A random-init model of the demo's shape (fastforward.demo.pipeline.DemoConfig), with a mask token."""
    model = tiny_model(prompts, vocab_size=512, hidden_size=192, layers=4, heads=6, kv_heads=6, seed=0)
    model.add_mask_token()
    return model


class ForwardTimer:
    """Times every `Model.run` call of one model (the forward pass and its cache update)."""

    def __init__(self, model: Model):
        self.durations: list[float] = []
        inner = model.run

        def timed(layout, cache):
            started = time.perf_counter()
            out = inner(layout, cache)
            self.durations.append(time.perf_counter() - started)
            return out

        model.run = timed


def measure(args: argparse.Namespace) -> dict:
    """One pass over every decoder and prompt in this process; per decoder: totals over prompts."""
    torch.set_num_threads(args.threads)
    examples = get_task("arithmetic").examples("test", args.n, seed=0)
    texts = [e.prompt for e in examples]
    options = {"dtype": args.dtype, "quantize": args.quantize, "exact": args.exact, "compile": args.compile}
    model = demo_shaped(texts) if args.model == "demo-shaped" else load_model(args.model, **options)
    if model.mask_token_id is None and args.quantize == "none":  # a quantized output layer cannot grow
        torch.manual_seed(0)  # the new embedding is drawn at random (mean resizing): the same in every run
        model.add_mask_token()  # untrained: SBD's tokens are meaningless here, its step cost is not
    prompts = [model.encode_prompt(t, chat_template=args.model != "demo-shaped") for t in texts]
    timer = ForwardTimer(model)
    out = {}
    for name in args.decoders.split(","):
        decoder = build_decoder(name, **DECODERS[name])
        decoder.generate(model, prompts[:1], args.max_new_tokens)  # warm-up
        totals = {"tokens": 0, "nfe": 0, "decode_s": 0.0, "forward_s": 0.0}
        for prompt in prompts:
            timer.durations.clear()
            started = time.perf_counter()
            gen = decoder.generate(model, [prompt], args.max_new_tokens)[0]
            wall = time.perf_counter() - started
            # The first Model.run is the prefill, inside stats.prefill_seconds: out of both sides.
            totals["tokens"] += gen.stats.tokens
            totals["nfe"] += gen.stats.nfe
            totals["decode_s"] += wall - gen.stats.prefill_seconds
            totals["forward_s"] += sum(timer.durations[1:])
        out[name] = totals
    return out


def summarise(totals: dict) -> dict:
    nfe = max(totals["nfe"], 1)
    return {
        "tokens": totals["tokens"],
        "nfe": totals["nfe"],
        "tpf": round(totals["tokens"] / nfe, 3),
        "step_ms": round(1000 * totals["decode_s"] / nfe, 4),
        "forward_ms": round(1000 * totals["forward_s"] / nfe, 4),
        "own_ms": round(1000 * (totals["decode_s"] - totals["forward_s"]) / nfe, 4),
        "tok_per_s": round(totals["tokens"] / totals["decode_s"], 2) if totals["decode_s"] else 0.0,
    }


def median_runs(runs: list[dict]) -> dict:
    """Per decoder, the run with the median decode speed (its split is internally consistent)."""
    out = {}
    for name in runs[0]:
        ranked = sorted((summarise(r[name]) for r in runs), key=lambda s: s["tok_per_s"])
        out[name] = ranked[len(ranked) // 2]
    return out


def run_child(args: argparse.Namespace, pythonpath: str | None) -> dict:
    """This script once, as a subprocess (on another checkout when `pythonpath` is given)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(HERE / "step_cost.py"), "--child", "--model", args.model, "--dtype", args.dtype]
    cmd += ["--threads", str(args.threads), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--decoders", args.decoders, "--quantize", args.quantize]
    cmd += ["--exact"] * args.exact + ["--compile"] * args.compile
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: dict[str, dict], other: dict[str, dict] | None) -> str:
    head = f"{'decoder':<13} {'TPF':>6} {'step ms':>8} {'forward':>8} {'own ms':>7} {'tok/s':>8}"
    if other:
        head += f" {'before':>8} {'own bef':>8} {'ratio':>6}"
    lines = [head]
    for name, s in rows.items():
        line = f"{name:<13} {s['tpf']:>6.2f} {s['step_ms']:>8.3f} {s['forward_ms']:>8.3f} {s['own_ms']:>7.3f} "
        line += f"{s['tok_per_s']:>8.1f}"
        if other:
            b = other[name]
            line += f" {b['tok_per_s']:>8.1f} {b['own_ms']:>8.3f} {s['tok_per_s'] / b['tok_per_s']:>6.2f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-shaped", help="demo-shaped (random init), a preset or a directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantize", default="none", choices=["none", "int8", "int4"], help="a preset or directory only")
    ap.add_argument("--exact", action="store_true", help="row-invariant attention (a preset or directory only)")
    ap.add_argument("--compile", action="store_true", help="compiled steps (a preset or directory only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=24, help="arithmetic test prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--decoders", default=",".join(DECODERS), help=f"comma-separated, from {', '.join(DECODERS)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs per tree; the median decode speed counts")
    ap.add_argument("--against", default=None, help="a checkout of another commit to compare with (A B A B)")
    ap.add_argument("--out", default=str(RESULTS / "step_cost.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    load_before = load_average()
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(run_child(args, None))
        if args.against:
            theirs.append(run_child(args, str(Path(args.against).resolve())))
    rows = median_runs(ours)
    other = median_runs(theirs) if theirs else None
    flags = f"quantize {args.quantize}" + ", exact" * args.exact + ", compiled" * args.compile
    print(f"model {args.model}, {args.dtype}, {flags}, {args.threads} thread(s), {args.n} prompts, batch 1, block 16")
    print(table(rows, other))
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "decoders": {name: DECODERS[name] for name in args.decoders.split(",")},
        "this_tree": rows,
        "against": other,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average {load_before} -> {result['load_average_after']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
