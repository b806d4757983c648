"""Row-invariant attention: a query's result depends only on the keys it sees, never on the other
queries of its forward.

A fused attention kernel computes a query's result differently depending on how many queries share
the call (block sizes, a different path for one query than for several), so a token's logits in a
16-token forward differ in the last bits from the same token's logits in a 1-token forward. With
int8 activations such a difference can flip a rounding and grow into a different argmax
(docs/notes/2026-11-28-precision-and-batch-invariance.md).

Here a query's computation is fixed by its own visible keys alone. Where fastforward's native
kernels run (`fastforward.cpu.native`: x86 with AVX2 or AVX-512), `fastforward::exact_attention` computes
each (query, head) as one task over exactly its visible keys, in key order, with the same
instructions whatever else is in the call: nothing is padded or copied, so it costs about what SDPA
does. Elsewhere (or with FASTFORWARD_EXACT_ATTENTION=chunked), chunked SDPA calls give the same
guarantee: a query's visible keys, in key order, are laid out from index 0 of a key buffer `width` =
`length` rounded up to a multiple of `CHUNK` (the rest zeros, masked); the query sits at row
`(length - 1) % CHUNK` of a `CHUNK`-row query buffer; one SDPA call computes the buffer. The call's
shapes and the query's row depend only on how many keys it sees, so a kernel that computes each row
from that row's inputs alone gives it the same bits in a 1-token forward (greedy AR) and in a block
of drafts. Masked keys contribute exact zeros. Queries of one forward that see nested prefixes of the
same keys (a causal block: every verifying decoder) share calls, one per `CHUNK` of lengths, so a
16-token block costs two or three calls per layer rather than sixteen. A query whose visible keys are
not one contiguous range (a candidate beside others, in `jacobi-mr`) has its keys gathered and a
call of its own. Together with row-invariant matmuls (`quantize.Int8Linear`, `Int4Linear`,
`w4a8.W4A8Linear`) a token's logits are the same bits whatever else shares its forward: verifying
decoders give greedy AR's tokens exactly. The two paths round differently, so one is chosen per
process (`native_kernel`).

It is chosen (`load_model(..., exact=True)`) rather than always on. A prefill (no cache yet) runs SDPA,
each row of a padded batch alone (`padded_prefill`): AR and every decoder start from the same prefill.
Registered with transformers' `AttentionInterface` as "fastforward_exact": no modeling file is touched.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fastforward.cpu import native
from fastforward.cpu.padded_prefill import attend_rows_apart
from fastforward.errors import FastForwardError

NAME = "fastforward_exact"


def row_invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, H, T, d]; key, value [B, Hkv, S, d]; attention_mask bool [B, 1, T, S] (True = may
    attend) or None (causal, the last T keys being the queries'). Returns [B, T, H, d]."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise FastForwardError("--exact attention has no logit soft-capping or attention sinks; use --no-exact")
    length, dim, total = query.shape[2], query.shape[3], key.shape[2]
    if total == length:  # a prefill (nothing cached): SDPA's speed is kept, each row alone in a padded batch
        return attend_rows_apart(
            sdpa_attention_forward, module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    scale = dim**-0.5 if scaling is None else scaling
    if not torch.compiler.is_compiling():
        return _attend(query, key, value, attention_mask, scale), None
    if _native is True and _native_fits(query):  # the kernel itself in the graph: one opaque operation
        return torch.ops.fastforward.exact_attention(query, key, value, attention_mask, scale).to(query.dtype), None
    return _opaque_attention(query, key, value, attention_mask, scale), None  # same calls, same bits


_native: bool | None = None  # whether the native kernel serves: decided at the first forward that needs it


def native_kernel() -> bool:
    """Whether `--exact` attention runs on the native kernel (`fastforward.cpu.native`): where it builds,
    unless FASTFORWARD_EXACT_ATTENTION=chunked asks for the chunked SDPA calls (to compare the two).
    Decided once per process, so that every forward of a model computes a query the same way."""
    global _native
    if _native is None:
        choice = os.environ.get("FASTFORWARD_EXACT_ATTENTION", "native")
        if choice not in ("native", "chunked"):
            raise FastForwardError(f"FASTFORWARD_EXACT_ATTENTION={choice!r}: choose native or chunked")
        _native = choice == "native" and native.available()
    return _native


def _native_fits(query: torch.Tensor) -> bool:
    """What the kernel takes: CPU tensors in float32 or bfloat16, head sizes in multiples of 16 up to 256."""
    dim = query.shape[-1]
    fits_dtype = query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)
    return fits_dtype and dim % 16 == 0 and dim <= 256


CHUNK = 8  # query rows per call; key buffers are whole multiples of it (8 measured faster than 4 or 16)


@dataclass
class _Call:
    """One SDPA call: queries `queries` of batch row `batch` at rows `rows` of the query buffer, over
    `width` keys taken from `start` on (`index` None) or gathered at `index`."""

    batch: int
    start: int
    index: torch.Tensor | None
    width: int
    queries: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    visible: torch.Tensor | None = None  # [groups · CHUNK, width], 0 or -inf, set by `_plan`
    query_slots: slice | list[int] = field(default_factory=list)  # `queries` as a slice where consecutive,
    row_slots: slice | list[int] = field(default_factory=list)  # `rows` likewise: indexing with a slice is a view

    def finish(self, device: torch.device | str, dtype: torch.dtype, groups: int, counts: list[int]) -> None:
        """Set the additive mask and the index slots, once the call's queries are all placed."""
        lengths = torch.full((CHUNK,), self.width)  # empty rows see everything (finite, unread)
        lengths[self.rows] = torch.tensor([counts[t] for t in self.queries])
        hidden = torch.arange(self.width) >= lengths[:, None]
        # an additive mask in the queries' dtype (SDPA would convert a boolean one in every layer)
        self.visible = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf")).repeat(groups, 1).to(device, dtype)
        self.query_slots, self.row_slots = _slots(self.queries), _slots(self.rows)


def _slots(indices: list[int]) -> slice | list[int]:
    consecutive = indices == list(range(indices[0], indices[0] + len(indices)))
    return slice(indices[0], indices[0] + len(indices)) if consecutive else indices


def _plan(
    attention_mask: torch.Tensor | None, batch: int, length: int, total: int, groups: int, dtype: torch.dtype
) -> list[_Call]:
    """Group the queries of a forward into calls (computed once per forward, shared by its layers)."""
    if attention_mask is None:  # causal: query t sees keys [0, total - length + t]
        starts = [[0] * length] * batch
        counts = [[total - length + t + 1 for t in range(length)]] * batch
        ranges = [[True] * length] * batch
    else:
        visible = attention_mask[:, 0]  # [B, T, S] boolean: fastforward's layouts and `sdpa_mask` both give one
        count = visible.sum(-1)
        first = visible.to(torch.uint8).argmax(-1)
        keys = torch.arange(total, device=visible.device)
        span = (keys >= first[..., None]) & (keys < (first + count)[..., None])
        starts, counts, ranges = first.tolist(), count.tolist(), (span == visible).all(-1).tolist()
    calls: list[_Call] = []
    for b in range(batch):
        shared: dict[tuple[int, int], list[_Call]] = {}  # (start, chunk) -> the calls over those keys
        firsts, repeats, seen_before = [], [], set()
        for t in range(length):
            if not ranges[b][t]:  # keys gathered for this query alone
                index = attention_mask[b, 0, t].nonzero()[:, 0]
                calls.append(_Call(b, 0, index, _width(counts[b][t]), [t], [(counts[b][t] - 1) % CHUNK]))
                continue
            key = (starts[b][t], counts[b][t])
            (repeats if key in seen_before else firsts).append(t)
            seen_before.add(key)
        # Every query first at its own row; then those that see exactly the keys of an earlier one
        # (masks of a block decoded together, never a verified token) wherever a row is free.
        for t, own_row in [(t, True) for t in firsts] + [(t, False) for t in repeats]:
            seen = counts[b][t]
            group = shared.setdefault((starts[b][t], (seen - 1) // CHUNK), [])
            row = (seen - 1) % CHUNK
            call = next((c for c in group if (row not in c.rows if own_row else len(c.rows) < CHUNK)), None)
            if call is None:
                call = _Call(b, starts[b][t], None, _width(seen))
                group.append(call)
                calls.append(call)
            call.queries.append(t)
            call.rows.append(row if own_row else min(set(range(CHUNK)) - set(call.rows)))
    device = attention_mask.device if attention_mask is not None else "cpu"
    for call in calls:
        call.finish(device, dtype, groups, counts[call.batch])
    return calls


def _width(seen: int) -> int:
    """Keys in the buffer of a query that sees `seen`: rounded up to a whole number of chunks."""
    return -(-seen // CHUNK) * CHUNK


class _PlanMemo(threading.local):
    """The plan of the last forward in this thread: its layers share one mask, so they share one
    plan (masks are compared by content: a caller may reuse a mask tensor, and inference tensors
    keep no version counter)."""

    mask: torch.Tensor | None = None
    key: tuple = ()
    plan: list[_Call] = []

    def get(self, mask: torch.Tensor | None, *shape: int | torch.dtype) -> list[_Call]:
        key = (CHUNK, *shape, None if mask is None else (mask.shape, mask.device))  # CHUNK: a benchmark varies it
        if key != self.key or (mask is not None and not torch.equal(mask, self.mask)):
            self.plan = _plan(mask, *shape)
            self.mask, self.key = None if mask is None else mask.clone(), key
        return self.plan


_plans = _PlanMemo()


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    if native_kernel() and _native_fits(query):
        return torch.ops.fastforward.exact_attention(query, key, value, attention_mask, scale).to(query.dtype)
    return _chunked(query, key, value, attention_mask, scale)


def _chunked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Where the native kernel does not run: chunked SDPA calls whose shapes depend on a query's key count."""
    batch, heads, length, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    out = query.new_empty(batch, length, heads, dim)
    for call in _plans.get(attention_mask, batch, length, total, groups, query.dtype):
        keys, values = _key_buffer(key, call), _key_buffer(value, call)
        rows = query.new_zeros(kv_heads, groups, CHUNK, dim)
        # [H, n, d] -> [Hkv, groups, n, d]: the query heads that share each key/value head
        rows[:, :, call.row_slots] = query[call.batch, :, call.query_slots].reshape(kv_heads, groups, -1, dim)
        result = torch.nn.functional.scaled_dot_product_attention(
            rows.reshape(1, kv_heads, groups * CHUNK, dim), keys, values, attn_mask=call.visible, scale=scale
        )
        picked = result.reshape(kv_heads, groups, CHUNK, dim)[:, :, call.row_slots]  # [Hkv, groups, n, d]
        out[call.batch, call.query_slots] = picked.permute(2, 0, 1, 3).reshape(-1, heads, dim)
    return out


def _key_buffer(source: torch.Tensor, call: _Call) -> torch.Tensor:
    """[1, Hkv, width, d]: the call's keys (or values) from index 0, zeros after them, contiguous: the
    same memory layout in every forward."""
    if call.index is not None:
        taken = source[call.batch].index_select(1, call.index)
    else:
        taken = source[call.batch, :, call.start : call.start + call.width]
    return torch.nn.functional.pad(taken, (0, 0, 0, call.width - taken.shape[1]))[None]


@torch.library.custom_op("fastforward::row_invariant_attention", mutates_args=())
def _opaque_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`_attend` as one operation that torch.compile does not look into: its loop over calls would
    otherwise be unrolled into a graph per layout, and compiled kernels would no longer give a query
    the same bits whatever else shares the forward."""
    return _attend(query, key, value, attention_mask, scale)


@_opaque_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float):
    batch, heads, length, dim = query.shape
    return query.new_empty(batch, length, heads, dim)


AttentionInterface.register(NAME, row_invariant_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # boolean masks, as for SDPA
