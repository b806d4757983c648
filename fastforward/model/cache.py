"""KV caches that append in place, and rolling entries back without copying.

transformers' `DynamicLayer` appends by concatenation: every forward copies the layer's whole cache
into a new tensor, so a decoding step's cost grows with the context
(docs/notes/2026-11-in-place-kv-cache.md). `GrowingLayer` keeps
its entries at the front of buffers with room to spare: an append writes only the new entries, and
the buffers double when they fill (`reserve`). `new_cache` gives every attention layer one, sliding
layers included: they keep every entry, and their masks hide what the window no longer shows
(`fastforward.model.windows`), for which the cache records each entry's RoPE position
(`track_positions`; `truncate` and `gather_entries` keep them in step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

MIN_CAPACITY = 64  # entries a buffer holds at first; it doubles from there


class GrowingLayer(CacheLayerMixin):
    """One layer's keys and values: the first `length` entries of buffers [batch, heads, capacity, dim].

    A compiled graph cannot grow the buffers without a branch it would guard on, so compiled
    forwards get their room beforehand (`reserve`); eager appends make their own."""

    is_sliding = False
    is_croppable = True

    def __init__(self) -> None:  # keys and values are views of the buffers, not attributes
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.length = 0
        self.is_initialized = False
        self.write_at: torch.Tensor | None = None  # cache slots of a fixed-shape step (`step_graphs`)

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_buffer is None else self.key_buffer[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_buffer is None else self.value_buffer[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def reserve(self, entries: int, like: torch.Tensor | None = None) -> None:
        """Make room for `entries` and one more (doubling the buffers); `like` gives batch, heads, dim
        and dtype for buffers not yet made. The spare entry keeps the keys a proper part of the
        buffer: a compiled graph that saw one would compile again for a cache that fills it."""
        if self.key_buffer is not None and self.key_buffer.shape[2] > entries:
            return
        like = like if self.key_buffer is None else self.key_buffer
        if like is None:
            return  # nothing appended yet: the first append makes the buffers
        capacity = MIN_CAPACITY if self.key_buffer is None else self.key_buffer.shape[2]
        batch, heads, dim = like.shape[0], like.shape[1], like.shape[3]
        while capacity <= entries:
            capacity *= 2
        buffers = []
        for old in (self.key_buffer, self.value_buffer):
            new = torch.empty(batch, heads, capacity, dim, dtype=like.dtype, device=like.device)
            if old is not None:
                new[:, :, : self.length] = old[:, :, : self.length]
            buffers.append(new)
        self.key_buffer, self.value_buffer = buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.write_at is not None:  # a fixed-shape step: its slots, and every query reads the whole buffer
            self.key_buffer.index_copy_(2, self.write_at, key_states)
            self.value_buffer.index_copy_(2, self.write_at, value_states)
            return self.key_buffer, self.value_buffer
        start, end = self.length, self.length + key_states.shape[2]
        if not torch.compiler.is_compiling():
            self.reserve(end, key_states)
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.length = end
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` entries (transformers 5.x counts them negative)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of entries to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        self.length = 0

    def _select(self, rows: torch.Tensor) -> None:
        if self.key_buffer is not None:
            self.key_buffer, self.value_buffer = self.key_buffer[rows], self.value_buffer[rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx.to(self.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.key_buffer is not None:
            self._select(torch.arange(self.key_buffer.shape[0], device=self.device).repeat_interleave(repeats))


def new_cache(config: PreTrainedConfig) -> DynamicCache:
    """A `DynamicCache` whose attention layers, full and sliding, append in place (`GrowingLayer`);
    other kinds of layer (linear attention) stay transformers' own."""
    cache = DynamicCache(config=config)
    attention = (DynamicLayer, DynamicSlidingWindowLayer)
    cache.layers = [GrowingLayer() if type(layer) in attention else layer for layer in cache.layers]
    cache.key_positions = None  # [B, entries] once tracked (`track_positions`)
    return cache


def track_positions(cache: Cache, positions: torch.Tensor) -> torch.Tensor:
    """Record the RoPE positions [B, T] of the entries a forward is about to append; returns the positions
    of every key that forward sees [B, entries + T] (the cache's, then the new ones)."""
    known = getattr(cache, "key_positions", None)
    if known is None:
        known = positions.new_zeros(positions.shape[0], cache.get_seq_length())
        if known.shape[1]:
            raise ValueError("the cache holds entries whose positions were not recorded")
    cache.key_positions = torch.cat([known, positions], dim=1)
    return cache.key_positions


def reserve(cache: Cache, entries: int) -> None:
    """Room for `entries` in every growing layer, before a compiled forward appends to it."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.reserve(entries)


def truncate(cache: Cache, length: int) -> None:
    """Keep the first `length` entries of every layer (no copy).

    transformers 5.x `crop` takes a negative count of entries to drop; 5.17 accepts the same.
    """
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot truncate a cache of {cache.get_seq_length()} entries to {length}")
    if extra:
        cache.crop(-extra)
    if getattr(cache, "key_positions", None) is not None:
        cache.key_positions = cache.key_positions[:, :length]


def drop_leading(cache: Cache, count: int) -> None:
    """Drop the first `count` entries of every row and layer (entries no query sees any more, after the
    rows that needed them left). Growing layers move what stays to the front of fresh buffers of the
    same capacity: a view past the dropped entries would keep the old strides, which compiled steps
    guard on, so a batch after a join or leave would run eagerly."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            kept = layer.length - count
            for name in ("key_buffer", "value_buffer"):
                old = getattr(layer, name)
                new = torch.empty_like(old, memory_format=torch.contiguous_format)
                new[:, :, :kept] = old[:, :, count : layer.length]
                setattr(layer, name, new)
            layer.length = kept
        else:
            layer.keys, layer.values = layer.keys[:, :, count:], layer.values[:, :, count:]
    if getattr(cache, "key_positions", None) is not None:
        cache.key_positions = cache.key_positions[:, count:]


def repack(cache: Cache, order: torch.Tensor) -> None:
    """Keep, for each row r, the entries `order[r]` ([B, W], ascending) as its W entries: the holes that
    rows leave behind (entries a decoder did not keep) and padding no row needs are squeezed out."""
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        index = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        keys, values = keys.gather(2, index), values.gather(2, index)
        if isinstance(layer, GrowingLayer):
            layer.key_buffer, layer.value_buffer, layer.length = keys, values, order.shape[1]
        else:
            layer.keys, layer.values = keys, values
    if getattr(cache, "key_positions", None) is not None:
        cache.key_positions = cache.key_positions.gather(1, order)


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
    positions = getattr(cache, "key_positions", None)
    if positions is not None:
        positions[:, base : base + order.shape[1]] = positions.gather(1, base + order)


def prepare_cache(cache: Cache, entries: int) -> None:
    """Get a cache ready for a compiled step that leaves it `entries` long: room in its growing
    layers (`cache.reserve`: a graph cannot grow them without a branch it would guard on), and the
    keys and values of transformers' own layers stored contiguously (a prefill's come out of a
    transpose and a truncated cache is a view; a new memory layout would compile a new graph)."""
    reserve(cache, entries)
    for layer in cache.layers:
        if not isinstance(layer, GrowingLayer) and not layer.keys.is_contiguous():
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()


def overwrite_rows(cache: Cache, rows: torch.Tensor, source: Cache) -> bool:
    """Write every row of `source` over the rows `rows` of `cache`, left-padded to its length with zero
    entries (which the caller's masks hide), in place: the other rows are not copied. Returns False,
    and changes nothing, where that cannot be done in place: a layer that is not a `GrowingLayer`, or
    a source longer than the cache."""
    length, theirs = cache.get_seq_length(), source.get_seq_length()
    layers = list(zip(cache.layers, source.layers, strict=True))
    if theirs > length or not all(isinstance(a, GrowingLayer) and isinstance(b, GrowingLayer) for a, b in layers):
        return False
    for mine, new in layers:
        for buffer, entries in ((mine.key_buffer, new.keys), (mine.value_buffer, new.values)):
            buffer[rows, :, :length] = F.pad(entries, (0, 0, length - theirs, 0))
    positions = getattr(cache, "key_positions", None)
    if positions is not None:
        positions[rows] = F.pad(source.key_positions, (length - theirs, 0))
    return True


def _runs(rows: Sequence[int]) -> list[slice]:
    """`rows` (ascending) as slices of consecutive rows: views of a cache's tensors, where indexing by
    the rows themselves would gather a copy before the copy into the stacked buffers."""
    runs: list[slice] = []
    for row in rows:
        if runs and runs[-1].stop == row:
            runs[-1] = slice(runs[-1].start, row + 1)
        else:
            runs.append(slice(row, row + 1))
    return runs


def stack_rows(
    config: PreTrainedConfig, caches: list[Cache], pads: list[int], rows: list[Sequence[int] | None] | None = None
) -> DynamicCache:
    """One batched cache from caches of growing layers, the rows of cache i (`rows[i]`, ascending,
    default all) left-padded by `pads[i]` zero entries (which the caller's masks hide): each row holds
    exactly the entries it held. Every entry is copied once, into buffers with room to grow."""
    rows = rows or [None] * len(caches)
    selections = [[slice(None)] if r is None else _runs(r) for r in rows]

    def parts(index: int, name: str) -> list[tuple[torch.Tensor, int]]:
        """(rows of one cache's tensor, their padding), in the stacked order."""
        found = [getattr(c.layers[index], name) for c in caches]
        return [(t[run], pad) for t, runs, pad in zip(found, selections, pads, strict=True) for run in runs]

    cache = new_cache(config)
    for index, layer in enumerate(cache.layers):
        keys, values = parts(index, "keys"), parts(index, "values")
        width = keys[0][0].shape[2] + keys[0][1]
        if not isinstance(layer, GrowingLayer):  # transformers' own layers: stacked as they are
            layer.update(*(torch.cat([F.pad(p, (0, 0, pad, 0)) for p, pad in t]) for t in (keys, values)))
            continue
        first = keys[0][0]
        like = first.new_empty(sum(k.shape[0] for k, _ in keys), first.shape[1], 1, first.shape[3])
        layer.lazy_initialization(like, like)
        layer.reserve(width, like)
        for buffer, stacked in ((layer.key_buffer, keys), (layer.value_buffer, values)):
            start = 0
            for part, pad in stacked:
                end = start + part.shape[0]
                buffer[start:end, :, :pad].zero_()  # padding: finite, so that masked attention stays finite
                buffer[start:end, :, pad:width] = part
                start = end
        layer.length = width
    positions = [getattr(c, "key_positions", None) for c in caches]
    if all(p is not None for p in positions):
        selected = [p if r is None else p[list(r)] for p, r in zip(positions, rows, strict=True)]
        cache.key_positions = torch.cat([F.pad(p, (pad, 0)) for p, pad in zip(selected, pads, strict=True)])
    return cache
