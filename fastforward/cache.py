"""A transformers KV cache that appends in place, and rolling back its entries without copying.

transformers' `DynamicLayer` concatenates on every append, copying the whole cache once per layer
and forward: on a CPU decoding a small model that copy is a tenth of a one-token step. A
`GrowingLayer` keeps its entries at the front of a zero-filled buffer with room to spare, writes new
entries after them and hands out a view; it copies only when the buffer fills up (growing by half).
Entries past the view are zeros or entries rolled back: finite, so the exact attention
(`fastforward.attention`) may read past the view into masked key slots instead of padding a copy.
"""

from __future__ import annotations

import weakref

import torch
from transformers import Cache, DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer

ROOM = 64  # buffers are whole multiples of this many entries (of `attention.CHUNK` in particular)

# The live buffers by address, for `spare_room` (inference-mode views do not record their base).
_buffers: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with room after them."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._views_fit(end):
            self._move_to_new_buffers(key_states, value_states, end)
        keys, values = self.buffers
        keys[..., length:end, :] = key_states
        values[..., length:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def _views_fit(self, end: int) -> bool:
        """The entries are still views of the buffers (a crop keeps them so; reordering the batch
        does not), and the buffers hold `end` entries."""
        if self.buffers is None or self.keys.numel() == 0:
            return False
        keys = self.buffers[0]
        return (
            end <= keys.shape[-2]
            and self.keys.data_ptr() == keys.data_ptr()
            and self.keys.stride() == keys.stride()
            and self.keys.shape[:2] == keys.shape[:2]
            and self.values.data_ptr() == self.buffers[1].data_ptr()
        )

    def _move_to_new_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        length = self.get_seq_length()
        room = -(-(end + max(end // 2, ROOM)) // ROOM) * ROOM
        buffers = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = new.new_zeros(*new.shape[:2], room, new.shape[-1])
            _buffers[buffer.data_ptr()] = buffer
            if length:
                buffer[..., :length, :] = old
            buffers.append(buffer)
        self.buffers = (buffers[0], buffers[1])


def new_cache(config: PreTrainedConfig) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers are `GrowingLayer`s (sliding-window
    layers and other kinds stay transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def spare_room(entries: torch.Tensor) -> bool:
    """Whether `entries` (a view of a cache's keys or values) sits in a `GrowingLayer` buffer, whose
    slots past the view are finite and may be read as masked keys."""
    return entries.untyped_storage().data_ptr() in _buffers


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
