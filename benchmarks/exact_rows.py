"""`--exact` attention on its native kernel against the chunked SDPA calls of each row count.

The native kernel (`fastforward::exact_attention`, where it builds) computes each query over exactly
its visible keys. Without it, each query is one row of a chunked SDPA call (`attention.CHUNK` rows):
fewer rows make a 1-token forward cheaper (its call computes that many rows, one of them real), more
rows let a block share fewer calls. This times `ar` and `lookup` on SmolLM2-135M at int4 with
`--exact`, batch 1, for each variant given ("native", or a row count for the chunked calls),
interleaved prompt by prompt in one process (the order rotates), over chat, `pycode` and `humaneval`
prompts, and checks that every output equals `ar`'s with the same variant. `--compile` runs
compiled steps (each variant's graphs are compiled in the warm-up). `--block-cost` also times causal
k-token forwards against a 256-token cache per variant (`roofline.measure_block_cost`, median of 7,
the fastest of 3 interleaved rounds). Prints tok/s per group and writes JSON with the load average.

    python benchmarks/exact_rows.py                          # native, rows 4 8 16; 4 prompts per group, about 12 min
    python benchmarks/exact_rows.py --variants native 8 --compile
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from common import RESULTS, load_average, log, prompt_groups, set_threads, write_report

from fastforward.api import build_decoder
from fastforward.cpu import attention, native
from fastforward.evaluation.evaluate import format_table
from fastforward.evaluation.roofline import measure_block_cost
from fastforward.model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants", nargs="+", default=["native", "4", "8", "16"], help="native, or query rows per chunked call"
    )
    parser.add_argument("--compile", action="store_true", help="compiled steps (fastforward.cpu.compiled)")
    parser.add_argument("--block-cost", action="store_true", help="also time k = 1, 4, 16 causal forwards")
    parser.add_argument("--n", type=int, default=4, help="prompts per group")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", default="int4", choices=["int8", "int4"])
    parser.add_argument("--out", type=Path, default=RESULTS / "exact_rows.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    if "native" in args.variants and not native.available():
        raise SystemExit("the native kernel does not run here (fastforward.cpu.native said why): drop 'native'")
    model = load_model("smollm2-135m", quantize=args.quantize, exact=True, compile=args.compile)
    decoders = {name: build_decoder(name) for name in ("ar", "lookup")}
    groups = prompt_groups(model, args.n)
    contenders = [(variant, name) for variant in args.variants for name in decoders]
    for variant, name in contenders:  # first calls allocate, pick kernels and compile graphs
        use(variant)
        decoders[name].generate(model, [groups["pycode"][0]], 32)
    tokens: dict[tuple, int] = defaultdict(int)
    seconds: dict[tuple, float] = defaultdict(float)
    outputs: dict[tuple, list] = defaultdict(list)
    for group, prompts in groups.items():
        for i, prompt in enumerate(prompts):
            for variant, name in contenders[i % len(contenders) :] + contenders[: i % len(contenders)]:
                use(variant)
                started = time.perf_counter()
                gen = decoders[name].generate(model, [prompt], args.max_new_tokens)[0]
                seconds[group, variant, name] += time.perf_counter() - started
                tokens[group, variant, name] += gen.stats.tokens
                outputs[group, variant, name].append(gen.token_ids)
            log(f"{group} {i + 1}/{len(prompts)}")
    table = [
        {
            "group": group,
            "variant": variant,
            "decoder": name,
            "tok_s": tokens[group, variant, name] / seconds[group, variant, name],
            "equal_ar": sum(
                a == b for a, b in zip(outputs[group, variant, name], outputs[group, variant, "ar"], strict=True)
            ),
        }
        for group in groups
        for variant, name in contenders
    ]
    columns = [
        ("group", "group", str),
        ("variant", "variant", str),
        ("decoder", "decoder", str),
        ("tok/s", "tok_s", lambda v: f"{v:.1f}"),
        ("= ar", "equal_ar", str),
    ]
    log(format_table(table, columns))
    blocks = block_costs(model, args.variants) if args.block_cost else {}
    for variant, times in blocks.items():
        log(
            f"{variant}: "
            + ", ".join(f"k={k} {ms:.2f} ms" for k, ms in times.items())
            + f"; t(16)/t(1) {times[16] / times[1]:.2f}"
        )
    write_report(
        args.out,
        load_before,
        threads,
        quantize=args.quantize,
        compile=args.compile,
        n_per_group=args.n,
        max_new_tokens=args.max_new_tokens,
        rows=table,
        block_cost_ms=blocks,
    )


def block_costs(model, variants: list[str], rounds: int = 3) -> dict[str, dict[int, float]]:
    """Milliseconds of causal k-token forwards per variant: the fastest median over interleaved rounds."""
    fastest: dict[str, dict[int, float]] = {variant: {} for variant in variants}
    for _ in range(rounds):
        for variant in variants:
            use(variant)
            for k, seconds in measure_block_cost(model, (1, 4, 16), repeats=7, dense_mask=False).times.items():
                fastest[variant][k] = min(fastest[variant].get(k, float("inf")), 1e3 * seconds)
    return fastest


def use(variant: str) -> None:
    """Route `--exact` attention to the native kernel, or to chunked calls of `variant` rows."""
    attention._native = variant == "native"
    if variant != "native":
        attention.CHUNK = int(variant)


if __name__ == "__main__":
    main()
