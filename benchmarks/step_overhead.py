"""What fusing the projections that read one input is worth (`fastforward.cpu.fusion`), per forward.

Builds SmolLM2-135M at int8 (or `--quantize int4`) with `--exact` twice, with fused projections
("fused", what `load_model` does) and with separate ones ("separate"), and times forwards of 1, 4
and 16 tokens against a 256-token cache for each (`roofline.measure_block_cost`), the two
interleaved round by round in one process; `--compile` compiles both models' steps first. Whole
decodes on this noisy 2-core machine varied more than the difference; the fastest of many forwards
does not. Also checks that `ar` decodes of chat, `pycode`
and `humaneval` prompts give the same tokens both ways (fusing must not move a bit). Prints the
fastest and median times and writes JSON with the load average.

    python benchmarks/step_overhead.py              # 6 rounds of 7 repeats, about 2 min
    python benchmarks/step_overhead.py --quantize int4 --compile    # a few minutes of warm-up more

int4 layers on PyTorch's int4 kernel are not fused: at commit 1e5d2cd this script measured them no
faster fused (docs/results.md). The native int4 kernel's layers are.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from statistics import median

from common import RESULTS, load_average, log, prompt_groups, set_threads, write_report

from fastforward.cpu.quantize import quantize
from fastforward.decoding.decoders import ARDecoder
from fastforward.evaluation.evaluate import format_table
from fastforward.evaluation.roofline import measure_block_cost
from fastforward.model import Model, load_model

VARIANTS = ("fused", "separate")


def variant_model(scheme: str, variant: str, compile_steps: bool) -> Model:
    model = load_model("smollm2-135m", exact=True, compile=compile_steps)  # compiles at the first step
    quantize(model.hf, scheme, fuse=variant == "fused")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", choices=["int8", "int4"], default="int8")
    parser.add_argument("--compile", action="store_true", help="compiled steps (fastforward.cpu.compiled)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7, help="timed forwards of each size per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "step_overhead.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    models = {(args.quantize, v): variant_model(args.quantize, v, args.compile) for v in VARIANTS}
    for model in models.values():  # compile (or allocate) before the timed rounds
        measure_block_cost(model, ks=(1, 4, 16), cache_len=256, repeats=1)
    fastest: dict[tuple, list[float]] = defaultdict(list)
    medians: dict[tuple, list[float]] = defaultdict(list)
    for round_ in range(args.rounds):
        for key in list(models)[round_ % len(models) :] + list(models)[: round_ % len(models)]:
            cost = measure_block_cost(models[key], ks=(1, 4, 16), cache_len=256, repeats=args.repeats)
            for k in cost.times:
                fastest[*key, k].append(cost.fastest[k])
                medians[*key, k].append(cost.times[k])
        log(f"round {round_ + 1}/{args.rounds}")
    prompts = [ids for group in prompt_groups(next(iter(models.values())), 1).values() for ids in group]
    outputs = {key: [g.token_ids for g in ARDecoder().generate(model, prompts, 48)] for key, model in models.items()}
    table = [
        {
            "quantize": scheme,
            "variant": variant,
            "k": k,
            "fastest_ms": 1e3 * min(fastest[scheme, variant, k]),
            "median_ms": 1e3 * median(medians[scheme, variant, k]),
            "fastest_vs_separate": min(fastest[scheme, variant, k]) / min(fastest[scheme, "separate", k]),
            "same_tokens": outputs[scheme, variant] == outputs[scheme, "separate"],
        }
        for scheme, variant in models
        for k in (1, 4, 16)
    ]
    columns = [
        ("quantize", "quantize", str),
        ("variant", "variant", str),
        ("k", "k", str),
        ("fastest ms", "fastest_ms", lambda v: f"{v:.2f}"),
        ("median ms", "median_ms", lambda v: f"{v:.2f}"),
        ("fastest / separate", "fastest_vs_separate", lambda v: f"{v:.2f}"),
        ("same tokens", "same_tokens", str),
    ]
    log(format_table(table, columns))
    write_report(
        args.out,
        load_before,
        threads,
        compiled=args.compile,
        rounds=args.rounds,
        repeats=args.repeats,
        cache_len=256,
        rows=table,
    )


if __name__ == "__main__":
    main()
