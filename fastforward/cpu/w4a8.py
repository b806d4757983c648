"""int4 weights times int8 activations, on x86 CPUs with AVX2 or AVX-512 VNNI: `W4A8Linear`.

PyTorch's CPU int4 kernel (`quantize.Int4Linear`) dequantizes every weight for every row it
multiplies, so a 16-token block cost about 5 times a 1-token forward, and Jacobi and lookup blocks
paid for it. This kernel (`csrc/w4a8.cpp`, compiled here once per machine) quantizes each row's
activations to int8 in blocks of 32 and takes an exact integer dot product with the 4-bit codes
(VPDPBUSD, or VPMADDUBSW on AVX2; both give the same bits), as llama.cpp does: the weights are read
and unpacked once per call, and each further row costs a fraction of the first. A row's result is
the same bits whatever the number of rows (tested), so every lossless decoder equals greedy AR at
int4; and it needs no bfloat16 copy of the weights for prefills, which it runs faster than a
bfloat16 GEMM (docs/notes/2026-11-native-int4-kernel.md).

Weights: groups of 32 inputs, w ≈ s · c + m with codes c in 0..15 and float16 s, m per group.

The kernel is one of fastforward's native kernels (`fastforward.cpu.native`, compiled once per machine).
Where they cannot be built or the CPU lacks AVX2, `--quantize int4` keeps PyTorch's int4
kernel (`quantize.Int4Linear`); so does FASTFORWARD_INT4_KERNEL=pytorch.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fastforward.cpu import native
from fastforward.errors import FastForwardError

GROUP = 32  # inputs per scale, in weights and activations alike
TILE = native.TILE  # output columns per kernel register: out_features must be a multiple
_KERNEL = torch.ops.fastforward.w4a8_linear.default  # the overload itself: no lookup per call


def fits(in_features: int, out_features: int) -> bool:
    """Whether the kernel takes these widths as they are (`W4A8Linear` pads other output widths)."""
    return in_features % GROUP == 0 and out_features % TILE == 0


def tiles(out_features: int) -> int:
    """Output width in whole tiles: what `W4A8Linear` packs (zero weights past `out_features`)."""
    return -(-out_features // TILE) * TILE


def enabled() -> bool:
    """Whether int4 layers use this kernel: where it runs, unless FASTFORWARD_INT4_KERNEL=pytorch asks
    for PyTorch's (to compare the two, or where this one misbehaves)."""
    choice = os.environ.get("FASTFORWARD_INT4_KERNEL", "native")
    if choice not in ("native", "pytorch"):
        raise FastForwardError(f"FASTFORWARD_INT4_KERNEL={choice!r}: choose native or pytorch")
    return choice == "native" and native.available()


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes packed for the kernel, float16 scales and minimums, codes [out, in] as integers).

    Codes are rounded against the float16 scale and minimum the kernel will use."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale16, low16 = ((high - low) / 15).half(), low.half()
    scale = scale16.float()[..., None]
    safe = torch.where(scale > 0, scale, torch.ones(()))
    codes = torch.where(scale > 0, torch.round((groups - low16.float()[..., None]) / safe), 0).clamp(0, 15)
    codes = codes.to(torch.uint8)
    # [tiles, 16 columns, groups, 8 quads, 4] -> [tiles, groups, quad, column, 4]; quads i and i + 4 share a byte
    quads = codes.reshape(out_features // TILE, TILE, -1, 8, 4).permute(0, 2, 3, 1, 4)
    packed = (quads[:, :, :4] | (quads[:, :, 4:] << 4)).reshape(out_features // TILE, -1).contiguous()
    scales = torch.cat([_by_tile(scale16), _by_tile(low16)], dim=-1).contiguous()  # [tiles, groups, 32]
    return packed, scales, codes.reshape(out_features, in_features)


def pack_low_rank(
    weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, B's groups read per tile) of W·x + B·(A·x) for `fastforward::w4a8_lowrank`, with W =
    weight, A = down, B = up (its input width, the rank, in whole groups): A's tiles, then each tile of
    outputs' groups of W followed by those of B it reads (`groups_read`), all packed as `pack` packs them."""
    (a_codes, a_scales, _), (w_codes, w_scales, _), (b_codes, b_scales, _) = pack(down), pack(weight), pack(up)
    tiles, groups, rank_groups = w_scales.shape[0], w_scales.shape[1], b_scales.shape[1]
    read = groups_read(b_scales)
    index = torch.arange(rank_groups)
    kept = torch.cat([torch.ones(tiles, groups, dtype=torch.bool), (index >= read[:, :1]) & (index < read[:, 1:])], 1)
    codes = torch.cat([w_codes.reshape(tiles, groups, -1), b_codes.reshape(tiles, rank_groups, -1)], 1)[kept]
    scales = torch.cat([w_scales, b_scales], 1)[kept]
    return torch.cat([a_codes.flatten(), codes.flatten()]), torch.cat([a_scales.flatten(), scales.flatten()]), read


def groups_read(scales: torch.Tensor) -> torch.Tensor:
    """For packed `scales` [tiles, groups, 32], each tile's first group and the end past its last with a scale
    or minimum other than zero, int32 [tiles, 2] ((0, 0): none): the groups a product by these weights must
    read, the others' weights all being zero."""
    read = (scales != 0).any(-1)
    groups = torch.arange(read.shape[1])
    first = torch.where(read, groups, read.shape[1]).amin(-1)
    end = torch.where(read, groups + 1, 0).amax(-1)
    return torch.stack([first.clamp_max(end), end], dim=-1).to(torch.int32).contiguous()


def _by_tile(per_group: torch.Tensor) -> torch.Tensor:
    """[out, groups] -> [tiles, groups, 16]: each tile's 16 columns side by side."""
    return per_group.reshape(-1, TILE, per_group.shape[1]).transpose(1, 2)


class W4A8Linear(nn.Module):
    """y = x · Wᵀ with W in 4-bit groups and x quantized to int8 per block of 32, by the native kernel.

    An output width that is not a whole number of tiles (an output layer grown by a mask token: 49,153 rows) is
    packed with zero rows up to the next tile and the extra columns are cut from the result (a view, no copy):
    each column is its own dot product, so the others keep their bits."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        padding = tiles(linear.out_features) - linear.out_features
        if padding:
            weight = torch.cat([weight, weight.new_zeros(padding, linear.in_features)])
        codes, scales, _ = pack(weight)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.padded = bool(padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An eager one-token step of SmolLM2-135M calls this 211 times: the kernel takes any layout and
        # dtype and returns the input's dtype, so a layer without a bias makes one call and nothing else.
        if self.padded:
            y = _KERNEL(x.float() if self.bias is not None else x, self.codes, self.scales)[..., : self.out_features]
        elif self.bias is None:
            return _KERNEL(x, self.codes, self.scales)
        else:
            y = _KERNEL(x.float(), self.codes, self.scales)
        return y if self.bias is None else (y + self.bias).to(x.dtype)
