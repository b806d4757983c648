"""What an adapter costs at int4: the shipped preset `smollm2-135m-jf-arithmetic` against its base.

    python benchmarks/adapter_cost.py                          # 1 and 2 threads, 3 rounds, ar and jacobi 8
    python benchmarks/adapter_cost.py --threads 1 --rounds 2 --n 6

Both models as `generate` serves the preset (int4 weights, `--exact`, the native int4 kernel where it
builds: the adapter's update kept beside the weights, `fastforward.cpu.low_rank`), on the same
held-out problems of the arithmetic task the adapter was trained for. Each decoder runs every prompt
on the base and on the adapted model in turn, the order swapped each round, so that load changes fall
on both alike; a ratio is taken within one round of one process, and the median over rounds is
reported. Tokens/s counts the prefill's time (as `generate` reports it); decode tokens/s leaves it out.
Both models decode exactly --max-new-tokens tokens, past their end of text, so that they run the same
positions: their answers differ (the adapted model's are about half as long on these problems), and at
their own lengths the prefill would weigh differently in the two rates (`--natural-length` does that).

Also recorded: whether `jacobi` gives `ar`'s tokens on each model (lossless at int4 `--exact`), and a
digest of the adapted model's `ar` tokens, which a change to how the update is computed must leave as
it is (compare it across commits). Writes benchmarks/results/adapter_cost.json with the machine, the
load average around each thread count, and every round's figures. The machines are shared: figures
under load are noisy; rerun on a quiet machine for the ones to keep.

Target (issue 72): the adapted model's `ar` at 0.95 times the base's tokens/s or more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from pathlib import Path

from common import RESULTS, load_average, log, machine_info, set_threads

from fastforward.api import build_decoder
from fastforward.cpu import native
from fastforward.decoding.rows import Prompt
from fastforward.evaluation.report import write_json
from fastforward.model import load_model
from fastforward.tasks import get_task

PRESET, BASE = "smollm2-135m-jf-arithmetic", "smollm2-135m"
SERVED = {"quantize": "int4", "exact": True}  # `fastforward generate`'s defaults for the preset
TASK = {"min_ops": 2, "max_ops": 3, "max_number": 20, "max_factor": 5}  # the preset's problems
TARGET = 0.95


def decode(decoder, model, prompt: list[int], max_new_tokens: int, fixed: bool = False) -> dict:
    g = decoder.generate(model, [Prompt(prompt, ignore_eos=fixed)], max_new_tokens)[0]
    stats = g.stats
    return {"ids": g.token_ids, "tokens": stats.tokens, "seconds": stats.seconds, "prefill": stats.prefill_seconds}


def rates(runs: list[dict]) -> dict:
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    decoded, decoding = sum(r["tokens"] - 1 for r in runs), sum(r["seconds"] - r["prefill"] for r in runs)
    return {"tokens": tokens, "tokens_per_s": tokens / seconds, "decode_tokens_per_s": decoded / decoding}


def update_layers(model) -> dict[str, int]:
    """How the adapted model computes its updates: its layers of each kind (by name, so that this script
    also runs on a checkout from before `W4A8LowRankLinear`, to compare)."""
    names = [type(m).__name__ for m in model.hf.modules()]
    return {name: names.count(name) for name in sorted(set(names)) if "LowRank" in name}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts, each timed in turn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=10, help="prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--block-size", type=int, default=8, help="jacobi's block")
    p.add_argument("--decoders", default="ar,jacobi")
    p.add_argument(
        "--natural-length",
        action="store_true",
        help="stop each answer at its end of text (the models then answer at different lengths, so prefill and "
        "attention weigh differently in their rates); by default both decode max-new-tokens past it",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "adapter_cost.json")
    args = p.parse_args()
    load_before = load_average()
    models = {"base": load_model(BASE, **SERVED), "adapted": load_model(PRESET, **SERVED)}
    examples = get_task("arithmetic", **TASK).examples("test", n=args.n, seed=0)
    prompts = [models["adapted"].encode_prompt(e.prompt) for e in examples]
    options = {"ar": {}, "jacobi": {"block_size": args.block_size}}
    decoders = {name: build_decoder(name, **options.get(name, {})) for name in args.decoders.split(",")}
    record = {
        "machine": {**machine_info(), "native_isa": native.instruction_set() if native.available() else None},
        "load_average_before": load_before,
        "models": {"base": BASE, "adapted": PRESET, "served": SERVED},
        "update_layers": update_layers(models["adapted"]),
        "prompts": args.n,
        "lengths": "natural (to the end of text)" if args.natural_length else "max_new_tokens, past the end of text",
        "max_new_tokens": args.max_new_tokens,
        "target": f"adapted ar tokens/s >= {TARGET} x the base's",
        "by_threads": {},
    }
    log(f"adapted model's update layers: {record['update_layers']}")
    for decoder in decoders.values():  # warm-up: first calls allocate and fill caches
        for model in models.values():
            decode(decoder, model, prompts[0], 8)
    outputs: dict[tuple[str, str], list] = {}
    fixed = not args.natural_length
    for threads in (int(t) for t in args.threads.split(",")):
        threads = set_threads(threads)
        before, rounds = load_average(), []
        for round_ in range(args.rounds):
            order = list(models) if round_ % 2 == 0 else list(reversed(models))
            runs = {(d, m): [] for d in decoders for m in models}
            for d, decoder in decoders.items():
                for prompt in prompts:
                    for m in order:
                        runs[(d, m)].append(decode(decoder, models[m], prompt, args.max_new_tokens, fixed))
            figures = {d: {m: rates(runs[(d, m)]) for m in models} for d in decoders}
            for d in decoders:
                base, adapted = figures[d]["base"], figures[d]["adapted"]
                figures[d]["ratio"] = adapted["tokens_per_s"] / base["tokens_per_s"]
                figures[d]["decode_ratio"] = adapted["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                log(
                    f"{threads} threads, round {round_ + 1}, {d}: base {base['tokens_per_s']:.1f} tok/s, "
                    f"adapted {adapted['tokens_per_s']:.1f} tok/s, ratio {figures[d]['ratio']:.3f} "
                    f"(decode only {figures[d]['decode_ratio']:.3f})"
                )
            rounds.append(figures)
            outputs.update({key: [r["ids"] for r in value] for key, value in runs.items()})
        summary = {
            d: {key: round(statistics.median(r[d][key] for r in rounds), 4) for key in ("ratio", "decode_ratio")}
            for d in decoders
        }
        record["by_threads"][str(threads)] = {
            "load_average_before": before,
            "load_average_after": load_average(),
            "median": summary,
            "rounds": rounds,
        }
        log(f"{threads} threads, median over {args.rounds} rounds: {json.dumps(summary)}")
    if "ar" in decoders:
        ids = outputs[("ar", "adapted")]
        record["adapted_ar_digest"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
        same = {d: {m: outputs[(d, m)] == outputs[("ar", m)] for m in models} for d in decoders if d != "ar"}
        record["equals_ar"] = same
        log(f"adapted ar tokens digest {record['adapted_ar_digest']}; the same tokens as ar: {same}")
    record["load_average_after"] = load_average()
    write_json(args.out, record)
    log(f"load average before {load_before}, after {record['load_average_after']}; wrote {args.out}")


if __name__ == "__main__":
    main()
