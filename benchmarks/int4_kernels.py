"""SmolLM2-135M's int4 linear layers on each int4 kernel, by rows per call, and whole causal blocks.

Loads the int4 model twice: on the native int4 x int8 kernel (fastforward.cpu.w4a8, what int4 uses where
it builds) and on PyTorch's `_weight_int4pack_mm_for_cpu` (FASTFORWARD_INT4_KERNEL=pytorch). Then,
interleaved round by round in one process:

- "layers": all 211 of the model's int4 layers called once each, in order, on random activations of
  k rows (the fastest of `--repeats`): the matmul cost of a k-token forward, nothing else;
- "forward": a causal k-token forward against a 256-token cache with `--exact`
  (`roofline.measure_block_cost(dense_mask=False)`, the blocks `lookup` and `jacobi` verify; median).

Prints milliseconds and each k's cost against k = 1, and writes JSON with the load average.

    python benchmarks/int4_kernels.py          # 3 rounds, about 2 minutes
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import RESULTS, load_average, load_smollm2, log, set_threads, write_report

from fastforward.cpu.quantize import Int4Linear
from fastforward.cpu.w4a8 import W4A8Linear
from fastforward.evaluation.evaluate import format_table
from fastforward.evaluation.roofline import measure_block_cost

KERNELS = {"native": W4A8Linear, "pytorch": Int4Linear}
LAYER_ROWS = (1, 2, 4, 8, 11, 16, 64)
FORWARD_ROWS = (1, 4, 8, 16)


def time_layers(layers: list[torch.nn.Module], rows: int, repeats: int) -> float:
    inputs = {width: torch.randn(rows, width) for width in {layer.in_features for layer in layers}}
    fastest = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            fastest = min(fastest, time.perf_counter() - started)
    return fastest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "int4_kernels.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    models = {kernel: load_smollm2(kernel, quantize="int4", exact=True) for kernel in KERNELS}
    layers = {kernel: [m for m in models[kernel].hf.modules() if isinstance(m, KERNELS[kernel])] for kernel in models}
    if not layers["native"]:
        raise SystemExit("the native int4 kernel does not run here (fastforward.cpu.w4a8 said why): nothing to compare")
    seconds: dict[tuple[str, str, int], float] = defaultdict(lambda: float("inf"))
    for round_ in range(args.rounds):
        for kernel in list(KERNELS)[round_ % 2 :] + list(KERNELS)[: round_ % 2]:
            for rows in LAYER_ROWS:
                key = (kernel, "layers", rows)
                seconds[key] = min(seconds[key], time_layers(layers[kernel], rows, args.repeats))
            cost = measure_block_cost(models[kernel], FORWARD_ROWS, repeats=args.repeats, dense_mask=False)
            for rows, median_s in cost.times.items():
                seconds[kernel, "forward", rows] = min(seconds[kernel, "forward", rows], median_s)
        log(f"round {round_ + 1}/{args.rounds}")
    table = [
        {
            "kernel": kernel,
            "what": what,
            "rows": rows,
            "ms": 1e3 * s,
            "vs_one_row": s / seconds[kernel, what, 1],
            "native_vs_pytorch": seconds["native", what, rows] / seconds["pytorch", what, rows],
        }
        for (kernel, what, rows), s in sorted(seconds.items(), key=lambda item: (item[0][1], item[0][2], item[0][0]))
    ]
    columns = [
        ("what", "what", str),
        ("rows", "rows", str),
        ("kernel", "kernel", str),
        ("ms", "ms", lambda v: f"{v:.2f}"),
        ("vs 1 row", "vs_one_row", lambda v: f"{v:.2f}"),
        ("native / pytorch", "native_vs_pytorch", lambda v: f"{v:.2f}"),
    ]
    log(f"{len(layers['native'])} int4 layers")
    log(format_table(table, columns))
    write_report(args.out, load_before, threads, rounds=args.rounds, repeats=args.repeats, rows=table)


if __name__ == "__main__":
    main()
