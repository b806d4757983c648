"""Prefill of new rows: left-padded causal forwards of their segments into one `KVCache`, called by
whoever starts a batch or adds rows to one (`runtime.prefilled`, before `Session` or `Session.join`).

A row's segments carry their own positions: a prompt, or for infilling a prefix and a suffix with
a gap between them. The cache afterwards equals a causal prefill of the same tokens in the same
order, and the rows are running.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from fastforward.cpu import padded_prefill
from fastforward.decoding.rows import Row, Status
from fastforward.model import Layout, Model, visibility
from fastforward.model.cache import KVCache

# Padded prompt tokens one prefill forward runs at most (more prefill in several: `prefill_chunks`).
PREFILL_TOKENS = 2048


def prefill_chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The prompts (by their lengths) to prefill together: indices in groups of similar length, each
    at most `budget` padded tokens (a longer prompt alone) with its longest prompt at most twice its
    shortest plus 8, so that padding at most about doubles a group's work. All in one group, in their
    order, when they fit (the usual case: a prompt alone, or a batch of similar ones)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    chunks = [[order[0]]]
    for index in order[1:]:
        chunk = chunks[-1]  # ascending: `index` is its longest prompt, chunk[0] its shortest
        if (len(chunk) + 1) * lengths[index] <= budget and lengths[index] <= 2 * lengths[chunk[0]] + 8:
            chunk.append(index)
        else:
            chunks.append([index])
    return [list(range(len(lengths)))] if len(chunks) == 1 else chunks


def prefill(model: Model, rows: list[Row], suffix_upfront: bool) -> tuple[KVCache, torch.Tensor]:
    """The cache of the rows' prefixes (and suffixes, `suffix_upfront`) and the logits after each
    prefix [B, V]; the rows are then running, their prefill timed.

    Prompts of very different lengths, or more prompt tokens than `PREFILL_TOKENS`, prefill in
    several forwards (`prefill_chunks`), whose caches are then stacked: padding a 6-token prompt to a
    400-token one costs as much as the long one, and on a CPU a token costs more in a very large
    forward (`benchmarks/prefill_chunks.py`). Under `--exact` a row's entries and logits do not depend
    on the rows it shares a forward with, so chunks change only the time; without it they may round
    differently, as in any batch."""
    start = time.perf_counter()
    tokens = [[*row.prefix, *(row.suffix if suffix_upfront else ())] for row in rows]
    chunks = prefill_chunks([len(t) for t in tokens], PREFILL_TOKENS)
    if len(chunks) == 1:
        cache, logits = _forward(model, rows, tokens)
    else:
        parts = [_forward(model, [rows[i] for i in c], [tokens[i] for i in c]) for c in chunks]
        stacked = [(part, len(c), None) for (part, _), c in zip(parts, chunks, strict=True)]
        cache = KVCache.stack(model.hf.config, stacked)
        order = torch.tensor([i for c in chunks for i in c], device=model.device).argsort()  # back to row order
        cache.select(order)
        logits = torch.cat([logits for _, logits in parts])[order]
    seconds = time.perf_counter() - start
    for row in rows:
        row.status, row.started, row.prefill_seconds = Status.RUNNING, start, seconds
    return cache, logits


def _forward(model: Model, rows: list[Row], tokens: list[list[int]]) -> tuple[KVCache, torch.Tensor]:
    """One left-padded forward over `rows` (their `tokens`, suffixes included) into a new cache, whose
    key validity marks the padding; returns it with each row's logits after its prefix."""
    device = model.device
    gaps = [row.limit if row.suffix else 0 for row in rows]
    positions = [
        [*range(row.origin), *range(row.origin + gap, len(t) + gap)]
        for row, t, gap in zip(rows, tokens, gaps, strict=True)
    ]
    width = max(len(t) for t in tokens)
    pads = [width - len(t) for t in tokens]
    ids = torch.tensor([[model.pad_token_id] * n + t for n, t in zip(pads, tokens, strict=True)], device=device)
    pos = torch.tensor([[0] * n + q for n, q in zip(pads, positions, strict=True)], device=device)
    cache = model.new_cache()
    mask = None  # the model's own causal path: no dense mask to build or read
    if any(pads):
        cache.key_valid = torch.arange(width, device=device)[None] >= torch.tensor(pads, device=device)[:, None]
        mask = visibility.over_cache(visibility.causal(width, device), 0, cache.key_valid)
    # Read where each prefix ends; rows with suffixes of different lengths read different slots.
    ends = [width - len(t) + row.origin - 1 for row, t in zip(rows, tokens, strict=True)]
    read = sorted(set(ends))
    reads = torch.tensor(read, device=device)
    if model.batch_invariant and len(rows) > 1:
        # Each row's attention alone, from its first token, under a one-prompt prefill's mask: its
        # entries and logits are a one-prompt prefill's bits (`padded_prefill`), padded or not.
        with padded_prefill.rows_apart(pads):
            logits = model.run(Layout(ids, pos, None, reads), cache)
    else:
        logits = model.run(Layout(ids, pos, mask, reads), cache)
    pick = torch.tensor([read.index(e) for e in ends], device=device)
    return cache, logits[torch.arange(len(rows), device=device), pick]
