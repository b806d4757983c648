"""Batch invariance on SmolLM2-135M: does a prompt decode to the same tokens alone and in a batch?

`--check`: for each precision, the `cpu_speed.py` prompts (chat's 8, and `--n` `pycode` and `humaneval`)
decoded one at a time with greedy `ar`, then in left-padded batches of 3 and of 8 with `ar` and
`jacobi`; counts the prompts whose tokens equal one-prompt `ar`'s. `--cost`: what batch invariance
costs: `ar` and `jacobi` at batch 1 and 8, tokens/s with the prefill and of the decoding steps alone
(the steady state: the tokens after each row's first over the steps' seconds), with `--exact`'s invariance
(a padded prefill's attention row by row, bfloat16 GEMMs in calls of probed row counts on packed
weights) and without it (SDPA over the padded batch, `nn.Linear`), interleaved in one process, median
of `--rounds`. `--gemm`:
whether torch's bfloat16 `linear` gives a row the same bits in calls of 33 to 400 rows (the kernel past
32 rows) and whether `--exact`'s fixed calls do (the sizes each shape's probe chose), wherever a row
sits; what one row and 136 rows cost in one `linear` and in fixed calls (and in calls of 16 and 32
rows), for SmolLM2-135M's shapes and larger ones.

    python benchmarks/batch_invariance.py --check        # 8 chat, 21 pycode, 21 humaneval prompts
    python benchmarks/batch_invariance.py --cost
    python benchmarks/batch_invariance.py --gemm

Writes benchmarks/results/batch_invariance_<modes>.json with the machine and its load average.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from unittest import mock

from common import RESULTS, load_average, load_smollm2, log, prompt_groups, set_threads, write_report
from torch import nn

import fastforward as ff
from fastforward import Generation
from fastforward.cpu.row_chunks import RowChunkedLinear
from fastforward.model import Model

PRECISIONS = {
    "float32": {},
    "bfloat16 --exact": {"dtype": "bfloat16", "exact": True},
    "int8 --exact": {"quantize": "int8", "exact": True},
    "int4 --exact": {"quantize": "int4", "exact": True},
}


def generate(model: Model, name: str, prompts: list[list[int]], batch: int, tokens: int) -> list[list[Generation]]:
    """The prompts in batches of `batch`, one list of generations per batch."""
    decoder = ff.build_decoder(name)
    return [decoder.generate(model, prompts[start : start + batch], tokens) for start in range(0, len(prompts), batch)]


def decode(model: Model, name: str, prompts: list[list[int]], batch: int, tokens: int) -> list[list[int]]:
    return [g.token_ids for group in generate(model, name, prompts, batch, tokens) for g in group]


def decoding_only(batches: list[list[Generation]]) -> tuple[int, float]:
    """Tokens after each row's first (which the prefill gives) and the seconds of the steps after the
    prefill: a batch's rows share one prefill and its steps run until its last row ends."""
    tokens = sum(len(g.token_ids) - 1 for group in batches for g in group)
    seconds = sum(max(g.stats.seconds for g in group) - group[0].stats.prefill_seconds for group in batches)
    return tokens, seconds


def check(args: argparse.Namespace) -> dict:
    table = {}
    for label in args.precisions:
        model = load_smollm2(**PRECISIONS[label])
        prompts = [p for group in prompt_groups(model, args.n).values() for p in group]
        alone = decode(model, "ar", prompts, 1, args.new_tokens)
        row = {}
        for name in ("ar", "jacobi"):
            for batch in (3, 8):
                batched = decode(model, name, prompts, batch, args.new_tokens)
                same = sum(a == b for a, b in zip(alone, batched, strict=True))
                row[f"{name} batch {batch}"] = f"{same}/{len(prompts)}"
        table[label] = row
        log(f"{label:18s} " + "   ".join(f"{k}: {v}" for k, v in row.items()))
    return table


@contextmanager
def without_invariance(model: Model):
    """`--exact` as it was before batch invariance: batched prefill, bfloat16 GEMMs by `nn.Linear`."""
    chunked = [m for m in model.hf.modules() if type(m) is RowChunkedLinear]
    for module in chunked:
        module.__class__ = nn.Linear
    try:
        with mock.patch.object(Model, "batch_invariant", property(lambda self: False)):
            yield
    finally:
        for module in chunked:
            module.__class__ = RowChunkedLinear


def cost(args: argparse.Namespace) -> dict:
    figures = {}
    for label in args.precisions:
        model = load_smollm2(**PRECISIONS[label])
        prompts = [p for group in prompt_groups(model, 8).values() for p in group][:8]
        runs: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name in ("ar", "jacobi"):
                for batch in (1, 8):
                    for variant in ("invariant", "not invariant"):
                        with without_invariance(model) if variant == "not invariant" else _nothing():
                            started = time.perf_counter()
                            batches = generate(model, name, prompts, batch, args.new_tokens)
                            seconds = time.perf_counter() - started
                        key = f"{name} batch {batch} {variant}"
                        runs.setdefault(key, []).append(sum(len(g.token_ids) for b in batches for g in b) / seconds)
                        steps_tokens, steps_seconds = decoding_only(batches)
                        runs.setdefault(f"{key}, decoding only", []).append(steps_tokens / steps_seconds)
        medians = {key: round(statistics.median(v), 2) for key, v in runs.items()}
        for name in ("ar", "jacobi"):
            for batch in (1, 8):
                for part in ("", ", decoding only"):
                    on = medians[f"{name} batch {batch} invariant{part}"]
                    off = medians[f"{name} batch {batch} not invariant{part}"]
                    what = f"batch {batch}{part or ', prefill included'}"
                    log(f"{label:18s} {name:7s} {what:29s}: {on:7.2f} tok/s invariant, {off:7.2f} not ({on / off:.3f})")
        figures[label] = medians
    return figures


# in → out features: SmolLM2-135M's projections and output layer, then Qwen2-0.5B's MLP and a 2048-wide model's
GEMM_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (896, 4864), (4864, 896), (2048, 8192)]


def gemm(args: argparse.Namespace) -> list[dict]:
    """Row invariance of torch's bfloat16 `linear` past 32 rows, and of `--exact`'s calls of the probed
    row counts on packed weights (`fastforward.cpu.row_chunks`); their costs (µs)."""
    import torch

    from fastforward.cpu.row_chunks import PACK_ROWS, _fixed_calls, call_sizes, plan

    torch.manual_seed(0)
    linear, rows = torch.nn.functional.linear, []

    def micros(call, repeats: int) -> float:
        for _ in range(10):
            call()
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        return round((time.perf_counter() - started) / repeats * 1e6, 1)

    for inputs, outputs in GEMM_SHAPES:
        weight = torch.randn(outputs, inputs, dtype=torch.bfloat16) * 0.05
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        sizes = list(call_sizes(weight, packed))
        x = torch.randn(400, inputs, dtype=torch.bfloat16)
        first = linear(x[:33], weight)
        changes = [
            m for m in (34, 40, 48, 64, 100, 128, 200, 300, 400) if not torch.equal(linear(x[:m], weight)[:33], first)
        ]

        def calls(rows: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            return _fixed_calls(rows, weight, None, packed, sizes)  # noqa: B023

        alone = torch.cat([calls(x[r : r + 1]) for r in range(300)])
        # each row alone, against rows 0..n-1 together and rows s..s+n-1 (each row in other places of a call)
        fixed = all(
            torch.equal(calls(x[s : s + n]), alone[s : s + n])
            for n in (2, 16, 17, 33, 47, 48, 49, 64, 65, 97, 128, 129, 200, 290)
            for s in (0, 7)
        )
        repeats = 30 if outputs * inputs > 5e6 else 300
        one, block = x[:1], x[:136]
        row = {
            "shape": f"{inputs}->{outputs}",
            "linear_row_changes_from_33_rows_at": changes,
            "call_sizes": sizes,
            "fixed_calls_invariant": fixed,
            "one_row_linear_us": micros(lambda: linear(one, weight), repeats),  # noqa: B023
            "one_row_fixed_calls_us": micros(lambda: calls(one), repeats),  # noqa: B023
            "136_rows_linear_us": micros(lambda: linear(block, weight), repeats),  # noqa: B023
            "136_rows_fixed_calls_us": micros(lambda: calls(block), repeats),  # noqa: B023
            "136_rows_calls": plan(136, tuple(sizes)),
            "136_rows_small_calls_us": micros(lambda: calls(block, [16, 32]), repeats),  # noqa: B023
        }
        log(str(row))
        rows.append(row)
    return rows


@contextmanager
def _nothing():
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--gemm", action="store_true", help="the bfloat16 GEMM's row invariance and cost")
    parser.add_argument("--n", type=int, default=21, help="`pycode` and `humaneval` prompts (and chat's 8)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS)[1:])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    figures = {"args": vars(args)}
    if args.check:
        figures["equal_to_one_prompt_ar"] = check(args)
    if args.cost:
        figures["tokens_per_second"] = cost(args)
    if args.gemm:
        figures["bfloat16_gemm"] = gemm(args)
    name = "batch_invariance" + "".join(f"_{m}" for m in ("check", "cost", "gemm") if getattr(args, m))
    write_report(RESULTS / f"{name}.json", load_before, threads, **figures)


if __name__ == "__main__":
    main()
