"""Measured block cost time(k)/time(1) of SmolLM2-135M on this machine (CPU by default).

One SBD decoding forward of k tokens (they see the whole cache and each other, their logits are
read, nothing is kept) against a cache of 256 and of 1024 tokens, in bf16 and fp32. Target: in
bf16, k=16 costs at most 1.3× k=1, so that the NFE savings of block decoding survive as wall-clock
savings on CPU too.

    python benchmarks/block_cost.py                      # full grid, writes benchmarks/results/block_cost.json
    python benchmarks/block_cost.py --dtypes bfloat16 --cache-lens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, load_average

from fastforward.evaluation.evaluate import write_json
from fastforward.evaluation.roofline import format_block_cost, measure_block_cost
from fastforward.model import DTYPES, load_model

TARGET_K, TARGET_RATIO = 16, 1.3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32"])
    p.add_argument("--cache-lens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=10, help="timed forwards per block size (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument("--no-read-logits", action="store_true", help="skip the output layer (hidden states only)")
    p.add_argument(
        "--causal-path",
        action="store_true",
        help="run the k tokens through the model's mask-free causal path (same work, no dense mask)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "block_cost.json")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    load_before = load_average()
    runs = []
    started = time.perf_counter()
    for dtype in args.dtypes:
        model = load_model(args.model, dtype=dtype, device=args.device)
        for cache_len in args.cache_lens:
            cost = measure_block_cost(
                model,
                args.blocks,
                cache_len=cache_len,
                repeats=args.repeats,
                warmup=args.warmup,
                read_logits=not args.no_read_logits,
                dense_mask=not args.causal_path,
            )
            print(format_block_cost(cost), end="\n\n", flush=True)
            runs.append(cost.as_dict())
        del model

    ks = sorted({k for r in runs for k in r["ratios"]})
    for r in runs:
        r["fastest_ratios"] = {k: t / r["fastest"][1] for k, t in r["fastest"].items()}
    print(
        f"time(k)/time(1), {args.model}, {args.threads} threads, {os.cpu_count()}-core {platform.machine()}, "
        f"load average {load_before[0]:.2f} before, {load_average()[0]:.2f} after"
    )
    print(f"{'stat':>7} {'dtype':>9} {'cache':>6} {'t(1) ms':>8} |" + "".join(f"{'k=' + str(k):>7}" for k in ks))
    for stat, times, ratios in (("median", "times", "ratios"), ("fastest", "fastest", "fastest_ratios")):
        for r in runs:
            cells = "".join(f"{r[ratios][k]:>7.3f}" if k in r[ratios] else f"{'—':>7}" for k in ks)
            print(f"{stat:>7} {r['dtype']:>9} {r['cache_len']:>6} {r[times][1] * 1e3:>8.2f} |{cells}")
    targets = [
        {
            "cache_len": r["cache_len"],
            "ratio": r["ratios"][TARGET_K],
            "fastest_ratio": r["fastest_ratios"][TARGET_K],
            "met": r["ratios"][TARGET_K] <= TARGET_RATIO,
        }
        for r in runs
        if r["dtype"] == "bfloat16" and TARGET_K in r["ratios"]
    ]
    for t in targets:
        verdict = "met" if t["met"] else "NOT met"
        print(
            f"target bf16 k={TARGET_K} <= {TARGET_RATIO}x k=1, cache {t['cache_len']}: median {t['ratio']:.3f} "
            f"({verdict}), fastest {t['fastest_ratio']:.3f}"
        )

    record = {
        "model": args.model,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "read_logits": not args.no_read_logits,
        "dense_mask": not args.causal_path,
        "loadavg_before": load_before,  # other work on the machine inflates and scatters the times
        "loadavg_after": load_average(),
        "seconds": time.perf_counter() - started,
        "target": {"k": TARGET_K, "max_ratio": TARGET_RATIO, "bf16": targets},
        "runs": runs,
    }
    write_json(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
