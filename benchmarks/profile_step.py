"""Where a one-token decoding step of SmolLM2-135M spends its time, by operation (torch profiler).

Prefills a chat prompt, then times one-token forwards against the cache (fastest and median of
`--repeats`), then profiles `--steps` more and prints the operations with the most time of their
own, per step. `--compile` runs the steps through `load_model(..., compile=True)`'s compiled
forward (its warm-up is reported apart). For choosing what to make cheaper next; it changes nothing.
Writes JSON with the load average.

    python benchmarks/profile_step.py                       # int4 --exact, eager, about 20 s
    python benchmarks/profile_step.py --compile             # compiled steps, a minute or more of warm-up
    python benchmarks/profile_step.py --compile --context 300 --cache dynamic   # transformers' own cache

`--context` sets the cache's length before the steps (the prompt repeated); `--cache dynamic` uses
transformers' `DynamicCache`, which concatenates the whole cache at every step, instead of
fastforward's (`fastforward.model.cache`, which appends in place).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, load_average, log, set_threads, write_report
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from fastforward.model import load_model
from fastforward.model.cache import prepare_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", default="int4", choices=["none", "int8", "int4"])
    parser.add_argument("--no-exact", dest="exact", action="store_false")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--repeats", type=int, default=20, help="timed one-token steps")
    parser.add_argument("--steps", type=int, default=10, help="profiled one-token steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=0, help="cache entries before the steps (at least the prompt)")
    parser.add_argument("--cache", choices=["growing", "dynamic"], default="growing")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_step.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    model = load_model("smollm2-135m", quantize=args.quantize, exact=args.exact, compile=args.compile)
    forward = model.hf if model.compiled_forward is None else model.compiled_forward
    cache = model.new_cache() if args.cache == "growing" else DynamicCache(config=model.hf.config)
    ids = model.encode_prompt("Explain how a hash map works in Python.")
    prompt = torch.tensor([(ids * (1 + args.context // len(ids)))[: max(args.context, len(ids))]])
    with torch.inference_mode():
        token = model.hf(input_ids=prompt, **{model.cache_argument: cache}, use_cache=True).logits[:, -1:].argmax(-1)

        def step() -> None:
            nonlocal token
            position = torch.tensor([[cache.get_seq_length()]])
            if args.compile:  # as `Model.run` prepares a compiled step
                prepare_cache(cache, cache.get_seq_length() + 1)
            out = forward(
                input_ids=token,
                position_ids=position,
                **{model.cache_argument: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            token = out.logits[:, -1:].argmax(-1)

        started = time.perf_counter()
        for _ in range(3):  # kernels picked, graphs compiled
            step()
        warm_up = time.perf_counter() - started
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(args.steps):
                step()
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [
        {
            "op": e.key,
            "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
            "calls_per_step": e.count / args.steps,
        }
        for e in events[: args.top]
    ]
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
    log(f"one-token step: fastest {1e3 * min(times):.2f} ms, median {1e3 * statistics.median(times):.2f} ms")
    log(f"warm-up (3 steps) {warm_up:.1f} s; profiled operations' own time {total:.2f} ms per step")
    for row in rows:
        log(f"{row['self_ms_per_step']:8.3f} ms  {row['calls_per_step']:7.1f} calls  {row['op']}")
    write_report(
        args.out,
        load_before,
        threads,
        quantize=args.quantize,
        exact=args.exact,
        compile=args.compile,
        cache=args.cache,
        context=prompt.shape[1],
        fastest_ms=1e3 * min(times),
        median_ms=1e3 * statistics.median(times),
        warm_up_s=warm_up,
        op_ms_per_step=total,
        top=rows,
    )


if __name__ == "__main__":
    main()
