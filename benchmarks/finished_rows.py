"""Finished rows: leave the batch at the step they finish (the engine core), or stay until the batch drains.

    python benchmarks/finished_rows.py                 # SmolLM2-135M, int4 --exact (generate's defaults)
    python benchmarks/finished_rows.py --model demo-jf --quantize none --no-exact --decoders jacobi

`fastforward generate --batch-size B` of prompts whose answers differ in length, two ways, interleaved
--rounds times in one process:

  leave   the engine core as it is: a row leaves at the step it finishes (its cache rows copied out), a
          waiting prompt takes its place
  stay    what in-process generate did before the engine core: B prompts at a time, finished rows
          padded around (they stay in every forward) until the last of the B finishes

Both give the same tokens (checked). Prints and writes (benchmarks/results/finished_rows.json) the
wall-clock seconds and tokens/s of each, their ratio, and the seconds the cache copies of rows leaving
and joining took in `leave` (the cost weighed against the compute of the rows that stay), with the load
average before and after. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from unittest import mock

import torch
from common import CHAT, RESULTS, load_average, log, set_threads, write_report

from fastforward.api import build_decoder
from fastforward.decoding.engine_core import EngineCore, generate
from fastforward.decoding.runtime import Session
from fastforward.model import load_model
from fastforward.tasks import get_task


def prompts(model, n: int) -> list[list[int]]:
    """Chat questions and short code problems, chat template on: answers of many lengths."""
    texts = list(CHAT) + [ex.prompt for ex in get_task("pycode").examples("test", n=n, seed=0)]
    return [model.encode_prompt(text) for text in texts[:n]]


@contextmanager
def rows_stay():
    """Finished rows stay in their batch until every row has finished (no `Session.leave`)."""

    def retire(self, setting):
        session = self.batches[setting][1]
        if all(row.finished for row in session.rows):
            del self.batches[setting]

    with mock.patch.object(EngineCore, "_retire", retire):
        yield


@contextmanager
def copy_clock(seconds: list[float]):
    """Add the seconds `Session.leave` and `Session.join` take (the cache copies) to `seconds`."""
    originals = {name: getattr(Session, name) for name in ("leave", "join")}

    def timed(name):
        def run(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)

        return run

    with mock.patch.multiple(Session, leave=timed("leave"), join=timed("join")):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--no-exact", action="store_true")
    parser.add_argument("--decoders", nargs="+", default=["ar", "jacobi"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    model = load_model(args.model, quantize=args.quantize, exact=not args.no_exact)
    asks = prompts(model, args.prompts)
    figures: dict[str, dict] = {}
    for name in args.decoders:
        decoder = build_decoder(name)
        generate(model, decoder, asks[:2], 4)  # warm-up
        seconds: dict[str, list[float]] = {"leave": [], "stay": []}
        copies: list[float] = []
        outputs = {}
        for _ in range(args.rounds):
            for way in ("leave", "stay"):
                start = time.perf_counter()
                if way == "leave":
                    with copy_clock(copies):
                        gens = generate(model, decoder, asks, args.max_new_tokens, batch_size=args.batch_size)
                else:
                    with rows_stay():
                        b = args.batch_size
                        gens = [
                            g
                            for i in range(0, len(asks), b)
                            for g in generate(model, decoder, asks[i : i + b], args.max_new_tokens)
                        ]
                seconds[way].append(time.perf_counter() - start)
                outputs[way] = [g.token_ids for g in gens]
        tokens = sum(len(ids) for ids in outputs["leave"])
        same = outputs["leave"] == outputs["stay"]
        best = {way: min(times) for way, times in seconds.items()}
        figures[name] = {
            "tokens": tokens,
            "same_tokens": same,
            "seconds": {way: [round(t, 3) for t in times] for way, times in seconds.items()},
            "tokens_per_s": {way: round(tokens / t, 2) for way, t in best.items()},
            "leave_over_stay": round(best["stay"] / best["leave"], 3),
            "copy_seconds_per_run": round(sum(copies) / args.rounds, 3),
            "answer_lengths": sorted(len(ids) for ids in outputs["leave"]),
        }
        log(
            f"{name}: leave {tokens / best['leave']:.1f} tok/s, stay {tokens / best['stay']:.1f} tok/s "
            f"(×{best['stay'] / best['leave']:.2f}; copies {sum(copies) / args.rounds:.3f} s a run; "
            f"median of runs {statistics.median(seconds['leave']):.2f} vs {statistics.median(seconds['stay']):.2f} s); "
            f"same tokens: {same}"
        )
    write_report(
        RESULTS / "finished_rows.json",
        load_before,
        threads,
        model=args.model,
        quantize=args.quantize,
        exact=not args.no_exact,
        prompts=args.prompts,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        decoders=figures,
        torch_threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
