"""How many query rows one call of `--exact` attention should hold (`fastforward.attention.CHUNK`).

Fewer rows make a 1-token forward cheaper (its call computes that many rows, one of them real);
more rows let a block share fewer calls. This times `ar` and `lookup` on SmolLM2-135M at int4 with
`--exact`, batch 1, for each row count given, interleaved prompt by prompt in one process (the order
rotates), over chat, `pycode` and `humaneval` prompts, and checks that every output equals `ar`'s
at the same row count. Prints tok/s per group and writes JSON with the load average.

    python benchmarks/exact_rows.py                 # rows 4 8 16, 4 prompts per group, about 10 min
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from common import RESULTS, load_average, log, prompt_groups, set_threads, write_report

from fastforward import attention
from fastforward.api import build_decoder
from fastforward.evaluate import format_table
from fastforward.model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16], help="query rows per call to compare")
    parser.add_argument("--n", type=int, default=4, help="prompts per group")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", default="int4", choices=["int8", "int4"])
    parser.add_argument("--out", type=Path, default=RESULTS / "exact_rows.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    model = load_model("smollm2-135m", quantize=args.quantize, exact=True)
    decoders = {name: build_decoder(name) for name in ("ar", "lookup")}
    groups = prompt_groups(model, args.n)
    contenders = [(rows, name) for rows in args.rows for name in decoders]
    for rows, name in contenders:  # first calls allocate and pick kernels
        attention.CHUNK = rows
        decoders[name].generate(model, [groups["pycode"][0]], 32)
    tokens: dict[tuple, int] = defaultdict(int)
    seconds: dict[tuple, float] = defaultdict(float)
    outputs: dict[tuple, list] = defaultdict(list)
    for group, prompts in groups.items():
        for i, prompt in enumerate(prompts):
            for rows, name in contenders[i % len(contenders) :] + contenders[: i % len(contenders)]:
                attention.CHUNK = rows
                started = time.perf_counter()
                gen = decoders[name].generate(model, [prompt], args.max_new_tokens)[0]
                seconds[group, rows, name] += time.perf_counter() - started
                tokens[group, rows, name] += gen.stats.tokens
                outputs[group, rows, name].append(gen.token_ids)
            log(f"{group} {i + 1}/{len(prompts)}")
    table = [
        {
            "group": group,
            "rows": rows,
            "decoder": name,
            "tok_s": tokens[group, rows, name] / seconds[group, rows, name],
            "equal_ar": sum(
                a == b for a, b in zip(outputs[group, rows, name], outputs[group, rows, "ar"], strict=True)
            ),
        }
        for group in groups
        for rows, name in contenders
    ]
    columns = [
        ("group", "group", str),
        ("rows", "rows", str),
        ("decoder", "decoder", str),
        ("tok/s", "tok_s", lambda v: f"{v:.1f}"),
        ("= ar", "equal_ar", str),
    ]
    log(format_table(table, columns))
    write_report(
        args.out,
        load_before,
        threads,
        quantize=args.quantize,
        n_per_group=args.n,
        max_new_tokens=args.max_new_tokens,
        rows=table,
    )


if __name__ == "__main__":
    main()
