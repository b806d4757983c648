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


def gather_entries(cache: Cache, base: int, order: torch.Tensor) -> None:
    """Move each row's entries `base + order[r]` (order [B, L]) to slots base..base+L-1 of that row.

    Used when a row keeps new entries that are not a prefix of what a forward appended (a winning
    candidate further along): only those entries are copied, in place; the caller then cuts the cache.
    """
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            index = (base + order)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            tensor[:, :, base : base + order.shape[1]] = tensor.gather(2, index)
