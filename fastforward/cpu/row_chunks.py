"""bfloat16 linear layers whose rows do not depend on each other: calls of fixed row counts.

oneDNN picks its bfloat16 GEMM kernel by the number of rows, so a row's result changes with how many
rows share the call (past a few dozen rows for some of SmolLM2-135M's shapes on the CPUs here). A
decoding step of a batch runs rows × block tokens through every layer, so a
row's logits moved with what shared its batch. With `--exact`, bfloat16 and float16 linear layers run
in calls whose row counts come from one set per layer, all of whose sizes compute a row to the same
bits wherever the row sits in the call. Which sizes do depends on the CPU, the thread count and the
shape, so each shape is probed when the model loads (`call_sizes`): it tries `SIZES` and keeps the
largest group that agrees; the groups found on the CPUs here differ from one CPU to the next
(docs/notes/2026-11-28-precision-and-batch-invariance.md). `python benchmarks/batch_invariance.py --gemm`
measures them. A step's rows go in the calls `plan`
picks: few calls (each reads all the weights), few rows computed twice or on zeros.

The calls go to oneDNN with the weights packed once at load (`_reorder_linear_weight`): an `nn.Linear`
call packs them again every time, which costs more than the product itself at a few rows, so a
one-row step's padded call on packed weights costs about what `nn.Linear`'s one row does (figures:
`--gemm` in docs/notes/2026-11-28-precision-and-batch-invariance.md). The packed copy is memory beside
the weights, which stay (the state dict, tied embeddings; docs/precision.md gives its size). The probe
runs at the thread count of the load; change threads before loading, not after.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fastforward.errors import FastForwardError

SIZES = (16, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 256)  # the row counts a probe tries
PACK_ROWS = 128  # the row count oneDNN packs the weights for
CALL_ROWS = 128  # what a call costs beyond its rows, in rows: at these widths each call reads every weight
PROBE_VALUES = 2**18  # outputs a probe compares per size: rows × out features, at least 64 rows, at most 1024
LOW_PRECISION = (torch.bfloat16, torch.float16)
PACKS = torch.backends.mkldnn.is_available()  # without oneDNN (not an x86 build): unpacked calls


def _product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=4096)
def plan(rows: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The calls (largest first) that cover `rows` at the least cost, a call costing `CALL_ROWS` plus
    its size: 136 rows take one call of 160 rather than 128 and 40. Past twice the largest size the
    extra rows go in calls of the largest."""
    largest = sizes[-1]
    bulk = max(0, rows // largest - 1)
    rest = rows - bulk * largest
    cost, last = [0] + [0] * rest, [0] * (rest + 1)  # the least cost of covering r rows, and its last call
    for r in range(1, rest + 1):
        cost[r], last[r] = min((CALL_ROWS + size + cost[max(0, r - size)], size) for size in sizes)
    calls, r = [], rest
    while r > 0:
        calls.append(last[r])
        r -= last[r]
    return (largest,) * bulk + tuple(sorted(calls, reverse=True))


def _fixed_calls(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    sizes: Sequence[int],
) -> torch.Tensor:
    """x [N, in] @ weight.T + bias in the calls of `plan`: the last ends at the last row, computing a few
    rows before it twice (kept once), or, when there are fewer rows than one call, on zero rows."""
    rows = x.shape[0]
    if not rows:
        return x.new_empty(0, weight.shape[0])
    calls = plan(rows, tuple(sizes))
    if rows < calls[0]:
        x = F.pad(x, (0, 0, 0, calls[0] - rows))
    parts, start = [], 0
    for size in calls:
        begin = min(start, max(0, rows - size))
        parts.append(_product(x[begin : begin + size], weight, bias, packed)[start - begin : rows - begin])
        start += size
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:rows]


@torch.library.custom_op("fastforward::row_invariant_linear", mutates_args=())
def _opaque_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None, sizes: list[int]
) -> torch.Tensor:
    """`_fixed_calls` as one operation that torch.compile does not look into: its loop over calls
    would otherwise specialise a graph on the row count, and inductor would not keep the call sizes."""
    return _fixed_calls(x, weight, bias, packed, sizes)


@_opaque_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None, sizes):
    return x.new_empty(x.shape[0], weight.shape[0])


def call_sizes(
    weight: torch.Tensor, packed: torch.Tensor | None, candidates: tuple[int, ...] = SIZES
) -> tuple[int, ...]:
    """The largest group of `candidates` that compute random rows to the same bits, in calls of that
    size and shifted by a few rows (ties: the group with the larger sizes). Two kernels differ in only
    a few rows in a hundred (their float32 sums mostly round to the same bfloat16 value, fewer rows the
    fewer outputs a row has), so the probe takes hundreds of rows."""
    rows = min(1024, max(64, PROBE_VALUES // weight.shape[0]))
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(rows, weight.shape[1], generator=generator).to(weight.device, weight.dtype)

    def through(size: int, shift: int) -> torch.Tensor:
        return _fixed_calls(F.pad(probe, (0, 0, shift, 0)), weight, None, packed, [size])[shift:]

    groups: list[tuple[torch.Tensor, list[int]]] = []
    for size in candidates:
        out = through(size, 0)
        if not torch.equal(through(size, 7), out):
            continue  # a row's bits depend on where it sits in the call: no use
        group = next((sizes for reference, sizes in groups if torch.equal(reference, out)), None)
        if group is None:
            groups.append((out, [size]))
        else:
            group.append(size)
    if not groups:
        raise FastForwardError(
            f"no call size computes a row of a {tuple(weight.shape)} {weight.dtype} layer to the same bits "
            "wherever it sits on this CPU: run without --exact, or in float32"
        )
    return tuple(max((sizes for _, sizes in groups), key=lambda sizes: (len(sizes), sizes[-1])))


class RowChunkedLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) computed in calls of fixed row counts."""

    packed: torch.Tensor | None
    sizes: tuple[int, ...]  # a tuple: `plan`'s cache key as it is, on every call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():  # the custom operation's schema takes a list
            out = _opaque_linear(flat, self.weight, self.bias, self.packed, list(self.sizes))
        else:  # eagerly without the custom operation's dispatch (tens of µs a call, hundreds of calls a step)
            out = _fixed_calls(flat, self.weight, self.bias, self.packed, self.sizes)
        return out.reshape(*x.shape[:-1], self.out_features)


_UNPACKABLE: set[torch.dtype] = set()  # dtypes oneDNN refused to pack on this CPU


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight packed for oneDNN, or None where it cannot be: no oneDNN, not on the CPU, or a dtype this CPU
    has no packed path for (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only EPYC refuses it)."""
    if not PACKS or weight.device.type != "cpu" or weight.dtype in _UNPACKABLE:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    except RuntimeError:
        _UNPACKABLE.add(weight.dtype)
        return None


def chunk_rows(model: nn.Module) -> int:
    """Make every bfloat16 or float16 `nn.Linear` of `model` a `RowChunkedLinear` (in place: the class
    changes, the parameters stay, a packed copy of the weights is added); returns how many. Each shape's
    call sizes are probed once."""
    probed: dict[tuple, tuple[int, ...]] = {}
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not nn.Linear or module.weight.dtype not in LOW_PRECISION:
                continue
            packed = pack_weight(module.weight)
            shape = (*module.weight.shape, module.weight.dtype, module.weight.device, packed is None)
            if shape not in probed:
                probed[shape] = call_sizes(module.weight, packed)
            module.__class__ = RowChunkedLinear
            module.register_buffer("packed", packed, persistent=False)
            module.sizes = probed[shape]
            changed += 1
    return changed
