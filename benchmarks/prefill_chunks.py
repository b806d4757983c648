"""Prefill in chunks: what one padded forward over prompts of mixed lengths costs against chunks.

    python benchmarks/prefill_chunks.py                    # SmolLM2-135M, int4 --exact (the server's defaults)
    python benchmarks/prefill_chunks.py --model demo-jf --quantize none --no-exact

New rows are prefilled left-padded (`prefill.prefill`), in one forward unless their lengths differ by more than
about 2x or their padded tokens pass `runtime.PREFILL_TOKENS` (then in chunks: `prefill_chunks`).
Two measurements, each repeated --rounds times with the settings interleaved:

  mixed      the first --rows prompts of `serve_load.py`'s chat workload (chat questions and code
             problems, 6 to 434 tokens on SmolLM2), prefilled in chunks (as now) and in one forward
  by size    n copies of one long prompt in one forward, n = 1, 2, 4, ..., --rows: seconds per token
             as the forward grows (where chunking at PREFILL_TOKENS pays on this CPU)

Prints min / median seconds and writes JSON (benchmarks/results/prefill_chunks.json) with the load
average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
from common import CHAT, RESULTS, load_average, log, write_report

from fastforward.decoding import prefill
from fastforward.decoding.runtime import start
from fastforward.model import load_model
from fastforward.tasks import get_task


def prompts(model, rows: int) -> list[list[int]]:
    """The chat workload of `serve_load.py --prompts chat`: chat questions and short code problems,
    raw text (no chat template), cycled and interleaved so that short and long prompts mix."""
    texts = list(CHAT) + [ex.prompt for ex in get_task("pycode").examples("test", n=8, seed=0)]
    ids = [model.encode_prompt(text, chat_template=False) for text in texts]
    short, long = ids[: len(CHAT)], ids[len(CHAT) :]
    mixed = [p for pair in zip(short, long, strict=False) for p in pair]
    return (mixed * (rows // len(mixed) + 1))[:rows]


def prefill_seconds(model, batch: list[list[int]], one_forward: bool = False) -> float:
    """Seconds to open a session of `batch` (its prefill), in chunks or (`one_forward`) in one forward."""
    one = mock.patch.object(prefill, "prefill_chunks", lambda lengths, budget: [list(range(len(lengths)))])
    with torch.inference_mode(), one if one_forward else contextlib.nullcontext():
        started = time.perf_counter()
        start(model, batch, 1)
        return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantize", default="int4", choices=("none", "int8", "int4"))
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=RESULTS / "prefill_chunks.json")
    args = p.parse_args()

    model = load_model(args.model, quantize=args.quantize, exact=args.exact)
    batch = prompts(model, args.rows)
    lengths = [len(b) for b in batch]
    chunks = prefill.prefill_chunks(lengths, prefill.PREFILL_TOKENS)
    log(f"{args.rows} prompts of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all): chunks {chunks}")
    longest = max(batch, key=len)
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= args.rows]
    prefill_seconds(model, batch[:2])  # first-call costs (kernels, allocator) out of the timings
    load_before = load_average()
    mixed: dict[str, list[float]] = {"chunks": [], "one forward": []}
    by_size: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(args.rounds):
        mixed["chunks"].append(prefill_seconds(model, batch))
        mixed["one forward"].append(prefill_seconds(model, batch, one_forward=True))
        for n in sizes:
            by_size[n].append(prefill_seconds(model, [longest] * n, one_forward=True))
    print(f"\n{args.model} ({args.quantize}{', --exact' if args.exact else ''}), {args.rows} mixed prompts")
    print("| prefill | seconds min / median |\n|---|---|")
    for name, times in mixed.items():
        print(f"| {name} | {min(times):.3f} / {statistics.median(times):.3f} |")
    print(f"\none forward of n x {len(longest)} tokens")
    print("| n | seconds min / median | ms per token (min) |\n|---|---|---|")
    for n, times in by_size.items():
        per_token = min(times) / n / len(longest) * 1e3
        print(f"| {n} | {min(times):.3f} / {statistics.median(times):.3f} | {per_token:.3f} |")
    write_report(
        args.json,
        load_before,
        torch.get_num_threads(),
        settings=vars(args) | {"json": str(args.json)},
        lengths=lengths,
        chunks=chunks,
        mixed=mixed,
        by_size={str(n): times for n, times in by_size.items()},
        long_prompt_tokens=len(longest),
    )


if __name__ == "__main__":
    main()
