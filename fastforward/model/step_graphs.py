"""Decoding steps replayed as CUDA graphs.

On a GPU a decoding step of a small model costs the host far more than the device: launching its
kernels one by one takes longer than running them (docs/notes/2026-11-26-first-gpu-run.md). A CUDA graph launches a
whole step's kernels at once. It fixes every shape and address it was captured with, so a graphed
step is a fixed-shape forward:

- The cache's entries live in buffers of a fixed capacity that `StepGraphs` owns per (batch,
  capacity) and binds the cache's growing layers to (their entries copied in once; a cache that
  outgrows its capacity moves to the next, twice as large).
- New entries are written at cache slots held in a device tensor (`GrowingLayer.write_at`), and
  every query attends to the whole capacity under a dense mask that hides the slots not in use.
- A step's length (and its number of reads) is rounded up to a power of two, then to a multiple of
  64 (`bucket`): padding tokens write to the slots after the step's own, which no real token sees,
  and each sees only its own slot.
- Tokens, positions, mask, slots and read positions are copied into the graph's own inputs before
  each replay; its logits are copied out after.

A shape is captured the second time it is seen, so one-off shapes (a last, shorter block) stay
eager; `ar`, `jacobi` at its block, `mbd --static` and `lookup`'s few draft lengths repeat theirs.
With a `step_length`, every step up to that many tokens runs at exactly that length: a token's logits
are then computed by the same kernels whether it is fed alone or inside a block, which lossless
decoders need to give AR's tokens bit for bit at bfloat16 on a GPU. It is not enough in a batch: on
one H100 `jacobi` and `lookup` gave `ar`'s tokens at batch 1 and not at batch 16 (SmolLM2-135M, 128
tokens; the tiny model of the CUDA test agreed). A likely cause, not verified: rows that accept
different counts leave holes in the shared slots, so a row's keys fall into the attention kernel's
key tiles differently than in `ar`'s run.
Without `capture` (a CPU, the tests) the same fixed-shape forward runs eagerly. Its logits equal an
eager step's up to kernel rounding (the mask over the capacity takes another attention kernel than
the causal path; 1e-4 in float32 in the tests), and every decoder gives the same tokens.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel

from fastforward.model.cache import GrowingLayer, KVCache

MIN_CAPACITY = 256  # cache slots of the smallest buffers; they double from there
CAPTURE_AFTER = 2  # a shape is captured when seen this many times
MAX_STEPS = 64  # shapes kept (graphs and inputs), least recently used dropped first
MAX_BUFFERS = 4  # (batch, capacity) buffer sets kept
BUFFER_SHARE = 0.25  # of a GPU's memory the buffer sets may hold together (least recently used go first)


@dataclass
class _Step:
    """The fixed inputs of one shape of step, its graph once captured, and the output it writes."""

    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # as the layout gives them: [B, T] or [1, T]
    mask: torch.Tensor  # [B, 1, T, capacity]: True = may attend
    offsets: torch.Tensor  # arange(T): the slots are past + offsets
    slots: torch.Tensor  # [T]: where the new entries go in the cache
    keys: torch.Tensor  # arange(capacity): the cache's slots, for masks
    read: torch.Tensor  # indices into T whose logits are returned
    seen: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


def bucket(count: int) -> int:
    """The length a step of `count` tokens (or reads) runs at: the next power of two up to 64, then the
    next multiple of 64. A decoder whose step length varies (`lookup`'s drafts, a verifier's blocks)
    then needs a few graphs, not one per length."""
    if count > 64:
        return -(-count // 64) * 64
    padded = 1
    while padded < count:
        padded *= 2
    return padded


def capacity_for(entries: int) -> int:
    """The buffer capacity that holds `entries`: MIN_CAPACITY doubled as often as needed."""
    capacity = MIN_CAPACITY
    while capacity < entries:
        capacity *= 2
    return capacity


def supports(cache: KVCache | None) -> bool:
    """Whether a cache can be bound: growing layers only, holding entries already (a step, not a
    prefill), and no recorded key positions (sliding-window masks are built per step from them)."""
    return (
        cache is not None
        and cache.key_positions is None
        and all(isinstance(layer, GrowingLayer) and layer.key_buffer is not None for layer in cache.layers)
    )


class StepGraphs:
    """Runs a model's steps against a cache as fixed-shape forwards, captured as CUDA graphs when `capture`."""

    def __init__(self, hf: PreTrainedModel, cache_argument: str, capture: bool, step_length: int | None = None):
        self.hf = hf
        # Every step of at most `step_length` tokens runs at exactly that length (and reads that many rows):
        # a token's logits are then the same bits in a one-token step as inside a block (one shape, one
        # kernel per operation, rows computed alike), so lossless decoders give AR's tokens at any precision.
        self.step_length = step_length
        self.cache_argument = cache_argument
        self.capture = capture
        self.steps: OrderedDict[tuple, _Step] = OrderedDict()
        self.buffers: OrderedDict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.owners: dict[tuple[int, int], weakref.ref] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        device = next(hf.parameters()).device
        # A set is layers x 2 x batch x KV heads x capacity x head size: 17 GB for an 8B model at batch 32
        # and 4096 slots, so sets are bounded by bytes too.
        self.budget = torch.cuda.get_device_properties(device).total_memory * BUFFER_SHARE if capture else math.inf
        self.failed: str | None = None  # why capturing stopped, when it failed

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visibility: torch.Tensor | None,
        read: torch.Tensor,
        cache: Cache,
    ) -> torch.Tensor:
        """The float32 logits [B, len(read), V] of a step; its T new entries are appended to `cache`."""
        batch, length = tokens.shape
        past = cache.get_seq_length()
        padded = self._length(length)
        capacity = capacity_for(past + padded)
        self._bind(cache, batch, capacity)
        reads = self._length(read.shape[0]) if read.dim() == 1 else read.shape
        shape = (batch, padded, positions.shape[0], reads, capacity)
        step = self.steps.get(shape)
        if step is None:
            step = self._new_step(batch, padded, positions.shape[0], reads, capacity, tokens.device)
            self.steps[shape] = step
            if len(self.steps) > MAX_STEPS:
                self.steps.popitem(last=False)
        self.steps.move_to_end(shape)
        self._fill(step, tokens, positions, visibility, read, past)
        if step.graph is None:
            step.seen += 1
            if self.capture and step.seen >= CAPTURE_AFTER:
                self._capture_or_give_up(step, cache)
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits[:, : read.shape[-1]].clone()  # the next replay overwrites the graph's output
        else:
            logits = self._forward(step, cache)[:, : read.shape[-1]]
        for layer in cache.layers:
            layer.length = past + length
        return logits

    def _length(self, count: int) -> int:
        """The length a step of `count` tokens (or reads) runs at: `step_length`, or else its bucket."""
        fixed = self.step_length
        return fixed if fixed is not None and count <= fixed else bucket(count)

    # ---- the cache's buffers ------------------------------------------------------------------
    def _bind(self, cache: Cache, batch: int, capacity: int) -> None:
        """Point the cache's layers at this runner's buffers for (batch, capacity), its entries copied in."""
        key = (batch, capacity)
        buffers = self.buffers.get(key)
        if buffers is not None:
            self.buffers.move_to_end(key)
            if all(layer.key_buffer is k for layer, (k, _) in zip(cache.layers, buffers, strict=True)):
                return
        else:
            shapes = [(b.shape[1], b.shape[3], b.dtype, b.device) for b in _all_buffers(cache.layers)]
            need = sum(batch * heads * capacity * size * dtype.itemsize for heads, size, dtype, _ in shapes)
            while self.buffers and (len(self.buffers) >= MAX_BUFFERS or self._bytes() + need > self.budget):
                self._drop(*self.buffers.popitem(last=False), binding=cache)
            made = [
                torch.zeros(batch, heads, capacity, size, dtype=dtype, device=where)
                for heads, size, dtype, where in shapes
            ]
            buffers = list(zip(made[::2], made[1::2], strict=True))
            self.buffers[key] = buffers
        owner = self.owners.get(key)
        if owner is not None and owner() is not None and owner() is not cache:
            _release(owner(), buffers)  # the other cache keeps its entries in buffers of its own
        for layer, pair in zip(cache.layers, buffers, strict=True):
            for name, target in zip(("key_buffer", "value_buffer"), pair, strict=True):
                source = getattr(layer, name)[:, :, : layer.length]
                if source.untyped_storage().data_ptr() == target.untyped_storage().data_ptr():
                    source = source.clone()  # a view of the same buffer (entries dropped from the front)
                target[:, :, : layer.length].copy_(source)
            layer.key_buffer, layer.value_buffer = pair
        self.owners[key] = weakref.ref(cache)

    def _bytes(self) -> int:
        return sum(t.nbytes for buffers in self.buffers.values() for pair in buffers for t in pair)

    def _drop(self, key: tuple[int, int], buffers: list, binding: Cache | None = None) -> None:
        """Forget a buffer set: its owner keeps its entries (the cache being bound reads them from it
        first), and the graphs that wrote into it go."""
        owner = self.owners.pop(key, None)
        if owner is not None and owner() is not None and owner() is not binding:
            _release(owner(), buffers)
        for shape in [s for s in self.steps if (s[0], s[-1]) == key]:
            del self.steps[shape]

    # ---- one step -----------------------------------------------------------------------------
    def _new_step(
        self, batch: int, length: int, position_rows: int, reads: int | torch.Size, capacity: int, device: torch.device
    ) -> _Step:
        return _Step(
            tokens=torch.zeros(batch, length, dtype=torch.long, device=device),
            positions=torch.zeros(position_rows, length, dtype=torch.long, device=device),
            mask=torch.zeros(batch, 1, length, capacity, dtype=torch.bool, device=device),
            offsets=torch.arange(length, device=device),
            slots=torch.empty(length, dtype=torch.long, device=device),
            keys=torch.arange(capacity, device=device),
            read=torch.zeros(reads, dtype=torch.long, device=device),
        )

    def _fill(
        self,
        step: _Step,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visibility: torch.Tensor | None,
        read: torch.Tensor,
        past: int,
    ) -> None:
        """Copy a step's inputs into the fixed ones (a few small copies, no host sync). Padding tokens
        (a bucket longer than the step) repeat its last token and position, go to the slots after its
        own, which no real token sees, and each sees its own slot (so that its attention is finite)."""
        length = tokens.shape[1]
        step.tokens[:, :length] = tokens
        step.tokens[:, length:] = tokens[:, -1:]
        step.positions[:, :length] = positions
        step.positions[:, length:] = positions[:, -1:]
        step.read[: read.shape[0]] = read  # reads past the step's own repeat a real one (cut off after)
        torch.add(step.offsets, past, out=step.slots)
        if visibility is None:  # causal: slot j is visible to new token t when j <= past + t
            torch.le(step.keys, step.slots[:, None], out=step.mask[0, 0])
            step.mask[1:] = step.mask[:1]
        else:
            torch.eq(step.keys, step.slots[:, None], out=step.mask[0, 0])  # the padding's own slots
            step.mask[1:] = step.mask[:1]
            step.mask[:, 0, :length, : past + length] = visibility

    def _forward(self, step: _Step, cache: Cache) -> torch.Tensor:
        for layer in cache.layers:
            layer.write_at = step.slots
        try:
            out = self.hf(
                input_ids=step.tokens,
                position_ids=step.positions,
                attention_mask=step.mask,
                **{self.cache_argument: cache},
                use_cache=True,
                logits_to_keep=step.read,
            )
        finally:
            for layer in cache.layers:
                layer.write_at = None
        return out.logits.float()

    def _capture_or_give_up(self, step: _Step, cache: Cache) -> None:
        """Capture the step; a model whose forward cannot be captured (one that reads a device value on
        the host, as some mixture-of-experts routings do) runs eagerly from then on, with a warning."""
        try:
            self._capture(step, cache)
        except RuntimeError as error:
            self.capture = False
            self.failed = f"capturing a step failed ({str(error).splitlines()[0]})"
            warnings.warn(f"CUDA graphs are off for this model: {self.failed}; steps run eagerly", stacklevel=4)

    def _capture(self, step: _Step, cache: Cache) -> None:
        """Capture the step, after one eager run on a side stream (lazy initialisations; CUDA graphs
        need it). That run writes this step's own entries to its own slots: the replay that follows
        writes the same."""
        side = torch.cuda.Stream(step.tokens.device)
        side.wait_stream(torch.cuda.current_stream(step.tokens.device))
        with torch.cuda.stream(side):
            self._forward(step, cache)
        torch.cuda.current_stream(step.tokens.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step.logits = self._forward(step, cache)
        step.graph = graph


def _all_buffers(layers: list) -> list[torch.Tensor]:
    """Keys, values, keys, values, ... of every layer."""
    return [b for layer in layers for b in (layer.key_buffer, layer.value_buffer)]


def _release(cache: Cache, buffers: list) -> None:
    """Give a cache whose layers use `buffers` copies of its own, so that another cache can have them."""
    for layer, (keys, _) in zip(cache.layers, buffers, strict=True):
        if layer.key_buffer is keys:
            layer.key_buffer, layer.value_buffer = layer.key_buffer.clone(), layer.value_buffer.clone()
