"""The native int4 kernel alone: SmolLM2-135M's int4 layers at one row, per shape and in step order.

    python benchmarks/int4_kernel.py                 # 2 threads, 50 rounds

A one-token step calls the kernel 211 times (7 projections in each of 30 layers, and the output
layer). Per shape: microseconds per call over every layer of that shape in turn, and the rate at
which its codes and scales are read (0.625 bytes a weight, as Q4_1). In step order: all 211 calls
as a step makes them, each layer's weights read from wherever the previous step left them (on the
Xeon here the 84 MB of weights stay in its L3). Random inputs: the kernel's time does not depend on
values. Writes benchmarks/results/int4_kernel.json with the load average.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import RESULTS, load_average, load_smollm2, log, set_threads, write_report

from fastforward.cpu.w4a8 import W4A8Linear


def per_call(layers: list[W4A8Linear], inputs: dict[int, torch.Tensor], rounds: int) -> float:
    """Seconds per call, calling `layers` in turn `rounds` times (after 3 rounds of warm-up)."""
    for _ in range(3):
        for layer in layers:
            layer(inputs[layer.in_features])
    started = time.perf_counter()
    for _ in range(rounds):
        for layer in layers:
            layer(inputs[layer.in_features])
    return (time.perf_counter() - started) / rounds / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    model = load_smollm2("native", dtype="float32", quantize="int4", exact=True)
    layers = [module for module in model.hf.modules() if isinstance(module, W4A8Linear)]
    if not layers:
        raise SystemExit("no native int4 layers: the native kernels did not build (python -m fastforward.cpu.native)")
    inputs = {layer.in_features: torch.randn(1, layer.in_features) for layer in layers}
    with torch.inference_mode():
        step = per_call(layers, inputs, args.rounds) * len(layers)
        log(f"all {len(layers)} calls in step order: {step * 1e3:.2f} ms a step")
        by_shape: dict[tuple[int, int], list[W4A8Linear]] = defaultdict(list)
        for layer in layers:
            by_shape[(layer.in_features, layer.out_features)].append(layer)
        shapes = []
        for (k, n), group in by_shape.items():
            seconds = per_call(group, inputs, args.rounds)
            rate = k * n * 0.625 / seconds / 1e9
            log(f"{k} -> {n}: {len(group)} layers, {seconds * 1e6:.1f} us a call, {rate:.1f} GB/s")
            shapes.append({"in": k, "out": n, "layers": len(group), "us_per_call": round(seconds * 1e6, 2)})
    write_report(RESULTS / "int4_kernel.json", load_before, threads, step_ms=round(step * 1e3, 3), shapes=shapes)


if __name__ == "__main__":
    main()
