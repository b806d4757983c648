"""Measure decoders of one model on held-out prompts, interleaved, and choose its decoding defaults.

Every contender decodes each prompt in turn (batch 1, greedy), so a change of load falls on all of them
alike; a lossless contender's tokens are compared with `ar`'s on every prompt. Tokens per second count
generation seconds with the prefill, as docs/results.md defines them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from fastforward.api import build_decoder
from fastforward.cpu.threads import cpu_model
from fastforward.decoding import metrics
from fastforward.decoding.decoders import Generation, registry
from fastforward.decoding.model_defaults import DecodingDefaults
from fastforward.model import Model
from fastforward.recipes.records import Record
from fastforward.tasks.jsonl import grade_answer

# A contender: the model and a decoder name with its options, by label.
Contender = tuple[Model, str, dict[str, Any]]


# A contender this much slower than `ar` (tokens/s) over the first SLOW_PROMPTS prompts decodes no more of them:
# its row says so, from what it decoded (a lossless decoder at 0.1x `ar` would otherwise take most of an
# evaluation's time and tell nothing its first prompts do not).
SLOW_PROMPTS, SLOW_SHARE = 3, 0.25


def decode_interleaved(
    contenders: dict[str, Contender],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    desc: str = "dev",
    reference: str | None = None,
) -> dict[str, list[Generation]]:
    """Every contender on each prompt in turn (batch 1); each one's generations in prompt order. With a
    `reference` label (`ar`), a contender below SLOW_SHARE of its tokens/s after SLOW_PROMPTS prompts stops there
    (its list is shorter)."""
    decoders = {label: build_decoder(name, **options) for label, (_, name, options) in contenders.items()}
    out: dict[str, list[Generation]] = {label: [] for label in contenders}
    running = dict(contenders)
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        for label, (model, _, _) in running.items():
            out[label].append(decoders[label].generate(model, [prompt], max_new_tokens)[0])
        if reference in out and i + 1 == SLOW_PROMPTS:
            floor = SLOW_SHARE * _tps(out[reference])
            running = {label: c for label, c in running.items() if label == reference or _tps(out[label]) >= floor}
    return out


def _tps(generations: Sequence[Generation]) -> float:
    return sum(g.stats.tokens for g in generations) / max(sum(g.stats.seconds for g in generations), 1e-9)


def summarize(
    generations: Sequence[Generation], records: Sequence[Record], reference: Sequence[Generation] | None = None
) -> dict[str, Any]:
    """TPF, tokens/s and tokens; accuracy when every record has an answer; against `reference` (the same
    model's `ar`), how many outputs are its tokens exactly; and each prompt's tokens, forwards (and grade), so
    that two rows on the same prompts can be compared prompt by prompt (the noise of a dev split)."""
    tokens = sum(g.stats.tokens for g in generations)
    row: dict[str, Any] = {
        "n": len(generations),
        "tokens": tokens,
        "tpf": metrics.tpf(tokens, sum(g.stats.nfe for g in generations)),
        "tps": tokens / max(sum(g.stats.seconds for g in generations), 1e-9),
    }
    prompts = {"tokens": [g.stats.tokens for g in generations], "nfe": [g.stats.nfe for g in generations]}
    if all(r.answer is not None for r in records):
        graded = [grade_answer(g.text, r.answer or "").correct for g, r in zip(generations, records, strict=True)]
        row["accuracy"] = sum(graded) / len(graded)
        prompts["correct"] = [int(c) for c in graded]
    row["prompts"] = prompts
    if reference is not None:
        row["equal_ar"] = sum(g.token_ids == r.token_ids for g, r in zip(generations, reference, strict=True))
    return row


def table(
    contenders: dict[str, Contender], records: Sequence[Record], prompts: Sequence[list[int]], max_new_tokens: int
) -> dict[str, dict[str, Any]]:
    """Each contender's summary on the prompts, with the conditions it was measured under (load average before
    and after, threads, CPU, token budget); every contender but `ar` is compared with `ar`'s tokens."""
    before = os.getloadavg()
    out = decode_interleaved(contenders, prompts, max_new_tokens, reference="ar" if "ar" in contenders else None)
    conditions = {
        "load_before": [round(x, 2) for x in before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "max_new_tokens": max_new_tokens,
    }
    rows = {}
    for label, g in out.items():
        reference = None if label == "ar" else out["ar"][: len(g)]
        rows[label] = summarize(g, records[: len(g)], reference)
        if len(g) < len(prompts):
            share = rows[label]["tps"] / rows["ar"]["tps"] if "ar" in rows else 0.0
            rows[label]["stopped"] = (
                f"after {len(g)} of {len(prompts)} prompts: {share:.2f}x ar's tokens/s, below {SLOW_SHARE}x"
            )
    return {label: {**row, "conditions": conditions} for label, row in rows.items()}


# How much faster than `ar` another decoder must be to become a model's default: more than interleaved runs
# of one decoder differ by, so that noise never picks a decoder that does not pay.
MARGIN = 1.05


def choose_defaults(
    rows: dict[str, dict[str, Any]], decoders: dict[str, tuple[str, dict[str, Any]]], where: str
) -> DecodingDefaults:
    """The fastest row (tokens/s) among `ar` and the lossless ones that gave `ar`'s tokens on every prompt and
    beat `ar` by `MARGIN`: the decoder a model runs when the user names none. `decoders`: each row's decoder
    and options, by label ("ar" among them); `where`: what the rows were measured on, for the record."""
    ar = next(label for label, (name, _) in decoders.items() if name == "ar")
    floor = MARGIN * rows[ar]["tps"]

    def pays(label: str) -> bool:
        row, lossless = rows[label], registry.spec(decoders[label][0]).lossless
        return label == ar or (lossless and row.get("equal_ar") == row["n"] and row["tps"] >= floor)

    exact = [label for label in decoders if pays(label)]
    best = max(exact, key=lambda label: rows[label]["tps"])
    chosen = DecodingDefaults(*decoders[best])
    row = rows[best]
    measured = (
        f"{chosen.describe()}: {row['tps'] / rows[ar]['tps']:.2f}x its own ar in tokens/s at TPF {row['tpf']:.2f}, "
        f"the fastest row equal to ar on all {row['n']} of {where}"
    )
    return replace(chosen, measured=measured)
