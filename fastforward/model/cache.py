"""KV caches that append in place, and rolling entries back without copying.

transformers' `DynamicLayer` appends by concatenation: every forward copies the layer's whole cache
into a new tensor, so a decoding step's cost grows with the context
(docs/notes/2026-11-in-place-kv-cache.md). `GrowingLayer` keeps its
entries at the front of buffers with room to spare: an append writes only the new entries, and the
buffers double when they fill (`reserve`).

`KVCache` is a batch's cache as one object of ours: transformers' cache (`hf`, whose attention
layers, sliding ones included, are growing layers) together with what a batch of rows needs beside
it: which entries each row sees (`key_valid`: left padding and the holes of entries a row did not
keep) and, for sliding-window models, each entry's RoPE position (`key_positions`: their masks hide
what the window no longer shows, `fastforward.model.windows`). Every operation on rows or entries
(truncating, keeping some of a step's entries, stacking, overwriting, selecting, squeezing and
repacking rows) keeps the three in step, so nothing is attached to transformers' objects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedConfig
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


class KVCache:
    """A batch's KV cache: transformers' cache `hf`, the validity of each row's entries [B, entries]
    (None: every entry real) and their RoPE positions [B, entries] (None: not tracked)."""

    # entries a cache may hold beyond twice its longest row before `squeeze` repacks it
    SQUEEZE_SLACK = 64

    def __init__(self, hf: DynamicCache):
        self.hf = hf
        self.key_valid: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None

    @classmethod
    def new(cls, config: PreTrainedConfig) -> KVCache:
        """An empty cache whose attention layers, full and sliding, append in place (`GrowingLayer`);
        other kinds of layer (linear attention) stay transformers' own."""
        hf = DynamicCache(config=config)
        attention = (DynamicLayer, DynamicSlidingWindowLayer)
        hf.layers = [GrowingLayer() if type(layer) in attention else layer for layer in hf.layers]
        return cls(hf)

    @property
    def layers(self) -> list[CacheLayerMixin]:
        return self.hf.layers

    def get_seq_length(self) -> int:
        return self.hf.get_seq_length()

    def validity(self, rows: int) -> torch.Tensor:
        """Which entries each of the `rows` rows sees [rows, entries] (all, where untracked)."""
        if self.key_valid is not None:
            return self.key_valid
        return torch.ones(rows, self.get_seq_length(), dtype=torch.bool, device=self._device())

    def _device(self) -> torch.device:
        return next(layer.keys.device for layer in self.layers if layer.keys is not None)

    # ---- entries ------------------------------------------------------------------------------
    def track_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Record the RoPE positions [B, T] of the entries a forward is about to append; returns the
        positions of every key that forward sees [B, entries + T] (the cache's, then the new ones)."""
        known = self.key_positions
        if known is None:
            known = positions.new_zeros(positions.shape[0], self.get_seq_length())
            if known.shape[1]:
                raise ValueError("the cache holds entries whose positions were not recorded")
        self.key_positions = torch.cat([known, positions], dim=1)
        return self.key_positions

    def extend_valid(self, length: int) -> None:
        """`length` new entries that every row sees, where validity is tracked (a step's, until it keeps some)."""
        if self.key_valid is not None:
            fresh = self.key_valid.new_ones(self.key_valid.shape[0], length)
            self.key_valid = torch.cat([self.key_valid, fresh], dim=1)

    def reserve(self, entries: int) -> None:
        """Room for `entries` in every growing layer, before a compiled forward appends to it."""
        for layer in self.layers:
            if isinstance(layer, GrowingLayer):
                layer.reserve(entries)

    def prepare(self, entries: int) -> None:
        """Get ready for a compiled step that leaves the cache `entries` long: room in its growing layers
        (a graph cannot grow them without a branch it would guard on), and the keys and values of
        transformers' own layers stored contiguously (a prefill's come out of a transpose and a
        truncated cache is a view; a new memory layout would compile a new graph)."""
        self.reserve(entries)
        for layer in self.layers:
            if not isinstance(layer, GrowingLayer) and not layer.keys.is_contiguous():
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries of every layer (no copy).

        transformers 5.x `crop` takes a negative count of entries to drop; 5.17 accepts the same.
        """
        extra = self.get_seq_length() - length
        if extra < 0:
            raise ValueError(f"cannot truncate a cache of {self.get_seq_length()} entries to {length}")
        if extra:
            self.hf.crop(-extra)
        if self.key_positions is not None:
            self.key_positions = self.key_positions[:, :length]
        if self.key_valid is not None:
            self.key_valid = self.key_valid[:, :length]

    def gather_entries(self, base: int, order: torch.Tensor) -> None:
        """Move each row's entries `base + order[r]` (order [B, L]) to slots base..base+L-1 of that row.

        Used when a row keeps new entries that are not a prefix of what a forward appended (a winning
        candidate further along): only those entries are copied, in place; the caller then cuts the cache.
        """
        for layer in self.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                index = (base + order)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                tensor[:, :, base : base + order.shape[1]] = tensor.gather(2, index)
        if self.key_positions is not None:
            self.key_positions[:, base : base + order.shape[1]] = self.key_positions.gather(1, base + order)

    def keep(self, base: int, rows: int, keep: list[int] | list[list[int]]) -> None:
        """Keep, of the entries from `base` on (one step's), per row a count of leading ones or the
        ascending slots to keep (moved into place). Entries a row keeps fewer of than another become
        holes: from then on validity is tracked per entry."""
        if keep and isinstance(keep[0], list):  # slot lists: move the kept entries into place
            counts = [len(slots) for slots in keep]
            high = max(counts)
            if any(slots != list(range(len(slots))) for slots in keep):
                order = [slots + [0] * (high - len(slots)) for slots in keep]
                self.gather_entries(base, torch.tensor(order, device=self._device()))
        else:
            counts = list(keep)
            high = max(counts)
        if min(counts) < high and self.key_valid is None:  # the first hole
            self.key_valid = self.validity(rows)
        self.truncate(base + high)
        if min(counts) == high:
            return
        device = self.key_valid.device
        kept = torch.arange(high, device=device)[None] < torch.tensor(counts, device=device)[:, None]
        self.key_valid = torch.cat([self.key_valid[:, :base], kept & self.key_valid[:, base:]], dim=1)

    # ---- rows ---------------------------------------------------------------------------------
    def select(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (in that order), entries as they are."""
        self.hf.batch_select_indices(index)
        if self.key_positions is not None:
            self.key_positions = self.key_positions[index]
        if self.key_valid is not None:
            self.key_valid = self.key_valid[index]

    def overwrite_rows(self, rows: list[int], source: KVCache, batch: int) -> bool:
        """Write every row of `source` over the rows `rows` of this cache (of `batch` rows), left-padded
        to its length with zero entries that no query sees, in place: the other rows are not copied.
        Returns False, and changes nothing, where that cannot be done in place: a layer that is not a
        `GrowingLayer`, or a source longer than the cache."""
        length, theirs = self.get_seq_length(), source.get_seq_length()
        layers = list(zip(self.layers, source.layers, strict=True))
        if theirs > length or not all(isinstance(a, GrowingLayer) and isinstance(b, GrowingLayer) for a, b in layers):
            return False
        at = torch.tensor(rows, device=self._device())
        for mine, new in layers:
            for buffer, entries in ((mine.key_buffer, new.keys), (mine.value_buffer, new.values)):
                buffer[at, :, :length] = F.pad(entries, (0, 0, length - theirs, 0))
        if self.key_positions is not None:
            self.key_positions[at] = F.pad(source.key_positions, (length - theirs, 0))
        valid = F.pad(source.validity(len(rows)), (length - theirs, 0), value=False)
        self.key_valid = self.validity(batch).index_put((at,), valid)
        return True

    @classmethod
    def stack(cls, config: PreTrainedConfig, parts: list[tuple[KVCache, int, Sequence[int] | None]]) -> KVCache:
        """One batched cache from (cache, its rows, the rows of it to take (ascending; None: all)) parts
        of growing layers, each left-padded to the longest with zero entries that no query sees: each
        row holds exactly the entries it held. Every entry is copied once, into buffers with room to grow."""
        widths = [cache.get_seq_length() for cache, _, _ in parts]
        width = max(widths)
        pads = [width - w for w in widths]
        selections = [[slice(None)] if rows is None else _runs(rows) for _, _, rows in parts]

        def pieces(index: int, name: str) -> list[tuple[torch.Tensor, int]]:
            """(rows of one part's tensor, their padding), in the stacked order."""
            found = [getattr(cache.layers[index], name) for cache, _, _ in parts]
            return [(t[run], pad) for t, runs, pad in zip(found, selections, pads, strict=True) for run in runs]

        stacked = cls.new(config)
        for index, layer in enumerate(stacked.layers):
            keys, values = pieces(index, "keys"), pieces(index, "values")
            if not isinstance(layer, GrowingLayer):  # transformers' own layers: stacked as they are
                layer.update(*(torch.cat([F.pad(p, (0, 0, pad, 0)) for p, pad in t]) for t in (keys, values)))
                continue
            first = keys[0][0]
            like = first.new_empty(sum(k.shape[0] for k, _ in keys), first.shape[1], 1, first.shape[3])
            layer.lazy_initialization(like, like)
            layer.reserve(width, like)
            for buffer, pieced in ((layer.key_buffer, keys), (layer.value_buffer, values)):
                start = 0
                for piece, pad in pieced:
                    end = start + piece.shape[0]
                    buffer[start:end, :, :pad].zero_()  # padding: finite, so that masked attention stays finite
                    buffer[start:end, :, pad:width] = piece
                    start = end
            layer.length = width

        def taken(tensor: torch.Tensor, rows: Sequence[int] | None) -> torch.Tensor:
            return tensor if rows is None else tensor[list(rows)]

        if all(cache.key_positions is not None for cache, _, _ in parts):
            stacked.key_positions = torch.cat(
                [F.pad(taken(c.key_positions, r), (pad, 0)) for (c, _, r), pad in zip(parts, pads, strict=True)]
            )
        if any(pads) or any(cache.key_valid is not None for cache, _, _ in parts):
            stacked.key_valid = torch.cat(
                [
                    F.pad(taken(c.validity(n), r), (pad, 0), value=False)
                    for (c, n, r), pad in zip(parts, pads, strict=True)
                ]
            )
        return stacked

    def squeeze(self, rows: int) -> None:
        """Drop the entries none of the `rows` rows sees: leading padding, and once holes (entries rows
        did not keep) make up most of the cache, every hole: each row's valid entries are packed to the
        right. A batch that rows keep joining would otherwise grow by the longest step of any row,
        forever. A single row keeps only its valid entries, and no validity."""
        if self.key_valid is None:
            return
        valid, length = self.key_valid, self.key_valid.shape[1]
        if not rows:  # every row left: nothing to keep
            self._drop_leading(length)
            self.key_valid = valid[:, :0]
            return
        if rows == 1:
            # One row needs no mask once its holes are gone: its steps then run as a prompt's alone do
            # (with compiled steps, one kind of step fewer for a server to compile).
            if not bool(valid.all()):
                self._repack(valid[0].nonzero().reshape(1, -1))
            self.key_valid = None
            return
        width = int(valid.sum(dim=1).max())
        if length > 2 * width + self.SQUEEZE_SLACK:  # amortised: each repack at least halves the cache
            slots = torch.arange(length, device=valid.device).expand(rows, -1)
            # each row's valid slots in order, right-aligned into `width` (the left filled with slot 0)
            ranked = torch.where(valid, slots, -1).sort(dim=1).values[:, length - width :]
            self._repack(ranked.clamp(min=0))
            self.key_valid = ranked >= 0
            return
        lead = int(valid.any(dim=0).long().argmax())
        if lead:
            self._drop_leading(lead)
            self.key_valid = valid[:, lead:]

    def _drop_leading(self, count: int) -> None:
        """Drop the first `count` entries of every row and layer. Growing layers move what stays to the
        front of fresh buffers of the same capacity: a view past the dropped entries would keep the old
        strides, which compiled steps guard on, so a batch after a join or leave would run eagerly."""
        for layer in self.layers:
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
        if self.key_positions is not None:
            self.key_positions = self.key_positions[:, count:]

    def _repack(self, order: torch.Tensor) -> None:
        """Keep, for each row r, the entries `order[r]` ([B, W], ascending) as its W entries."""
        for layer in self.layers:
            keys, values = layer.keys, layer.values
            index = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            keys, values = keys.gather(2, index), values.gather(2, index)
            if isinstance(layer, GrowingLayer):
                layer.key_buffer, layer.value_buffer, layer.length = keys, values, order.shape[1]
            else:
                layer.keys, layer.values = keys, values
        if self.key_positions is not None:
            self.key_positions = self.key_positions.gather(1, order)


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
