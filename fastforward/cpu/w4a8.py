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
    return in_features % GROUP == 0 and out_features % TILE == 0


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


def _by_tile(per_group: torch.Tensor) -> torch.Tensor:
    """[out, groups] -> [tiles, groups, 16]: each tile's 16 columns side by side."""
    return per_group.reshape(-1, TILE, per_group.shape[1]).transpose(1, 2)


class W4A8Linear(nn.Module):
    """y = x · Wᵀ with W in 4-bit groups and x quantized to int8 per block of 32, by the native kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        codes, scales, _ = pack(linear.weight)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An eager one-token step of SmolLM2-135M calls this 211 times: the kernel takes any layout and
        # dtype and returns the input's dtype, so a layer without a bias makes one call and nothing else.
        if self.bias is None:
            return _KERNEL(x, self.codes, self.scales)
        return (_KERNEL(x.float(), self.codes, self.scales) + self.bias).to(x.dtype)
