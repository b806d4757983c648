"""bfloat16 linear layers whose rows do not depend on each other: calls of fixed row counts.

oneDNN picks its bfloat16 GEMM kernel by the number of rows, so a row's result changes with how many
rows share the call (on the 2-core Xeon here, AVX-512 BF16 and AMX: from 33 rows on for some of
SmolLM2-135M's shapes). A decoding step of a batch runs rows × block tokens through every layer, so a
row's logits moved with what shared its batch. With `--exact`, bfloat16 and float16 linear layers run
in calls whose row counts come from one set per layer, the last call zero-padded. Every size of a set
computes a row to the same bits, wherever the row sits in the call:

- `LARGE` (48, 64, 96, 128 rows) holds on some shapes, not all (at 576 → 192, 96 rows take the small
  calls' kernel), so each shape is probed when the model loads (`call_sizes`);
- `SMALL` (16, 32 rows) held on every shape measured here (SmolLM2-135M's, Qwen2-0.5B's MLP,
  2048 ↔ 8192, at 1 and 2 threads) and serves where `LARGE` does not. It is probed too: on the 16-core
  Xeon beside the H100 (torch 2.11) 16 and 32 rows differed at most of SmolLM2-135M's shapes, which
  then take calls of 32 rows alone (`LARGE` held there at 1 and 2 threads, mostly not at 16).
  `python benchmarks/batch_invariance.py --gemm` measures both.

The calls go to oneDNN with the weights packed once at load (`_reorder_linear_weight`): an `nn.Linear`
call packs them again every time, which costs more than the product itself at a few rows, so a
one-row step's padded call on packed weights costs about what `nn.Linear`'s one row does (figures:
`--gemm` in docs/results.md). The packed copy is memory beside the weights, which stay (the state
dict, tied embeddings): SmolLM2-135M in bfloat16 holds 1100 MB with it, 808 MB without. The probe
runs at the thread count of the load; change threads before loading, not after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LARGE = (48, 64, 96, 128)
SMALL = (16, 32)
PROBE_VALUES = 2**18  # outputs a probe compares per size: rows × out features, at least 64 rows, at most 1024
LOW_PRECISION = (torch.bfloat16, torch.float16)
PACKS = torch.backends.mkldnn.is_available()  # without oneDNN (not an x86 build): unpacked calls


def _product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _fixed_calls(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None, sizes: list[int]
) -> torch.Tensor:
    """x [N, in] @ weight.T + bias in calls of the largest of `sizes` rows; the rest in one call of the
    smallest size that holds it, filled with the rows before it (computed twice, kept once) or, when
    there are too few, with zeros."""
    rows, largest = x.shape[0], sizes[-1]
    if not rows:
        return x.new_empty(0, weight.shape[0])
    full = rows - rows % largest
    parts = [_product(x[start : start + largest], weight, bias, packed) for start in range(0, full, largest)]
    if full < rows:
        size = next(size for size in sizes if size >= rows - full)
        if size > rows:
            x = F.pad(x, (0, 0, 0, size - rows))
        start = min(full, rows - size) if size <= rows else 0
        parts.append(_product(x[start : start + size], weight, bias, packed)[full - start :])
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
    weight: torch.Tensor, packed: torch.Tensor | None, candidates: tuple[tuple[int, ...], ...] = (LARGE, SMALL)
) -> tuple[int, ...]:
    """`LARGE`, else `SMALL`: the first of `candidates` each of whose sizes computes random rows to the same bits,
    in calls of that size and shifted by a few rows; else calls of `SMALL[-1]` alone. Two kernels differ
    in 1 to 10 % of rows of SmolLM2-135M's shapes (their float32 sums mostly round to the same bfloat16
    value, fewer rows the fewer outputs a row has), so the probe takes hundreds of rows."""
    rows = min(1024, max(64, PROBE_VALUES // weight.shape[0]))
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(rows, weight.shape[1], generator=generator).to(weight.device, weight.dtype)

    def through(size: int, shift: int) -> torch.Tensor:
        return _fixed_calls(F.pad(probe, (0, 0, shift, 0)), weight, None, packed, [size])[shift:]

    def agree(sizes: tuple[int, ...]) -> bool:
        reference = through(sizes[0], 0)
        return all(torch.equal(through(size, shift), reference) for size in sizes for shift in (0, 7))

    return next((sizes for sizes in candidates if agree(sizes)), SMALL[-1:])


class RowChunkedLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) computed in calls of fixed row counts."""

    packed: torch.Tensor | None
    sizes: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        # eagerly without the custom operation's dispatch (tens of µs a call, hundreds of calls a step)
        product = _opaque_linear if torch.compiler.is_compiling() else _fixed_calls
        out = product(flat, self.weight, self.bias, self.packed, self.sizes)
        return out.reshape(*x.shape[:-1], self.out_features)


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
            packed = None
            if PACKS and module.weight.device.type == "cpu":
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), LARGE[-1])
            shape = (*module.weight.shape, module.weight.dtype, module.weight.device, packed is None)
            if shape not in probed:
                probed[shape] = call_sizes(module.weight, packed)
            module.__class__ = RowChunkedLinear
            module.register_buffer("packed", packed, persistent=False)
            module.sizes = list(probed[shape])
            changed += 1
    return changed
