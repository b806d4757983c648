"""A LoRA update kept beside quantized weights, as QLoRA serves it: y = W·x + B·(A·x), every product quantized.

Merging an adapter into the weights and then quantizing them to int4 erased what it had learned
(issue 59: a Jacobi Forcing adapter fell from 56.7 % to 0 % accuracy, an `ntp` one from 85 % to
3.3 %). SmolLM2's weights come from a Q4_1 GGUF: they already sit on a 4-bit grid of groups of 32,
the grid int4 quantizes to, and an update far smaller than one step of it rounds back to the base's
codes. Kept apart, the base quantizes to its own codes and the update keeps its effect.

A's rows are appended to W's, so one call of the quantized layer gives W·x and h = A·x side by side;
B (the adapter's scale folded in) is a second quantized layer whose input width, the rank, is padded
with zeros to a whole group of 32. Both are layers of the model's scheme (the native int4 kernel,
PyTorch's int4 kernel, or int8 where int4 cannot take the shape), and each computes a row by itself,
so a token's result still does not depend on what shares its forward (`--exact`).

Where both products take the native int4 kernel, `W4A8LowRankLinear` makes them one call
(`fastforward::w4a8_lowrank`), which gives the two calls' bits (float32 inputs). The second call, the
slice and the addition had made an adapted SmolLM2-135M decode at 0.68-0.85 times the base's tokens/s.
B read apart from W also cost far more than its bytes (a 576 x 32 B a quarter of the time of the
576 x 576 W it updates, both read from memory; 1 thread, AVX2), so each tile of outputs keeps B's
groups right after W's, read in one stream, and only those it reads (a fused group's B is
block-diagonal).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastforward.cpu import w4a8

_KERNEL = torch.ops.fastforward.w4a8_lowrank.default
RANK_GROUP = 32  # the rank is padded to a multiple of this: the kernels' input group (and a multiple of 16 rows)


class LowRank:
    """A low-rank update ΔW = up · down of one linear layer: down [r, in], up [out, r] (scale folded in)."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor):
        self.down, self.up = down.detach().float(), up.detach().float()

    def __add__(self, other: LowRank) -> LowRank:
        """Two updates of one layer (a chain of adapters) as one of their summed rank."""
        return LowRank(torch.cat([self.down, other.down]), torch.cat([self.up, other.up], dim=1))

    @staticmethod
    def side_by_side(updates: list[LowRank | None], widths: list[int]) -> LowRank:
        """The update of layers that read one input, fused into one of `widths` outputs (`fastforward.cpu.fusion`):
        their first factors stacked, each padded to whole groups (`padded`), so that each layer's part of
        A·x is quantized in blocks of its own, as it would be apart (the same bits); their second ones
        block-diagonal (None: a layer without an update)."""
        padded = [None if u is None else u.padded() for u in updates]
        kept = [u for u in padded if u is not None]
        rank, at = sum(u.down.shape[0] for u in kept), 0
        up = torch.zeros(sum(widths), rank)
        row = 0
        for update, width in zip(padded, widths, strict=True):
            if update is not None:
                r = update.down.shape[0]
                up[row : row + width, at : at + r] = update.up
                at += r
            row += width
        return LowRank(torch.cat([u.down for u in kept]), up)

    def padded(self) -> LowRank:
        """The rank padded with zero rows and columns to a multiple of `RANK_GROUP` (the same update)."""
        extra = -self.down.shape[0] % RANK_GROUP
        return LowRank(nn.functional.pad(self.down, (0, 0, 0, extra)), nn.functional.pad(self.up, (0, extra)))


def add_update(updates: dict[str, LowRank], name: str, update: LowRank) -> None:
    """Add `update` to layer `name`'s in `updates` (another adapter of a chain: side by side, summed)."""
    updates[name] = updates[name] + update if name in updates else update


class LowRankLinear(nn.Module):
    """y = base(x) + up(down(x)) (+ the bias), with base and down one quantized layer and up another."""

    def __init__(
        self,
        linear: nn.Linear,
        update: LowRank,
        quantized: Callable[[nn.Linear], nn.Module],
        quantized_up: Callable[[nn.Linear], nn.Module],
    ):
        """quantized, quantized_up: the scheme's quantized layer for an `nn.Linear`, for the base with the
        update's first factor, and for its second (`quantize._quantized`)."""
        super().__init__()
        update = update.padded()
        rank = update.down.shape[0]
        stacked = nn.Linear(linear.in_features, linear.out_features + rank, bias=False)
        up = nn.Linear(rank, linear.out_features, bias=False)
        with torch.no_grad():
            stacked.weight.copy_(torch.cat([linear.weight.detach().float(), update.down]))
            up.weight.copy_(update.up)
        self.stacked, self.up = quantized(stacked), quantized_up(up)
        # added last, in W4A8LowRankLinear's order
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.stacked(x)
        y = both[..., : self.out_features] + self.up(both[..., self.out_features :])
        return y if self.bias is None else (y + self.bias).to(x.dtype)


class W4A8LowRankLinear(nn.Module):
    """`LowRankLinear` in one call of the native int4 kernel: y = W·x + B·(A·x) (+ the bias)."""

    def __init__(self, linear: nn.Linear, update: LowRank):
        super().__init__()
        update = update.padded()
        codes, scales, up_groups = w4a8.pack_low_rank(linear.weight.detach().float(), update.down, update.up)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("up_groups", up_groups)
        self.rank = update.down.shape[0]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:  # the kernel takes any layout and dtype, and returns the input's dtype
            return _KERNEL(x, self.codes, self.scales, self.up_groups, self.rank)
        return (_KERNEL(x.float(), self.codes, self.scales, self.up_groups, self.rank) + self.bias).to(x.dtype)
