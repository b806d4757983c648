"""Quantized linear layers for CPU decoding: int8 weights with int8 activations, and int4 weights.

On a CPU a forward of a small model is bound by reading its weights, so weight bytes are what cost.

`int8` (`Int8Linear`): int8 weights with one scale per output channel; each token's activations are
quantized to int8 with their own scale at run time; an integer matmul (`torch._int_mm`, int32
accumulation) and the two scales applied after it. Integer sums are exact and every scale belongs
to one token, so a token's result does not depend on how many tokens share the forward: the linear
layers give the same bits in a 1-token and a 16-token forward (tested). This is the scheme of
torchao's `Int8DynamicActivationInt8WeightConfig`, written out here in five tensor operations:
torchao's own version made a 1-token forward slower than fp32's, its per-token quantization costing
more than the matmul saves (docs/notes/2026-11-torchao-vs-our-kernels.md). `load_model` first smooths
the activations' outlier channels into the weights (`fastforward.cpu.smoothing`, calibrated on built-in
text), which brings the int8 model's greedy choices much closer to fp32's.

`int4`: int4 weights in groups of 32 with a scale and offset each (asymmetric). On x86 CPUs with
AVX2 or AVX-512, `fastforward.cpu.w4a8.W4A8Linear`: activations quantized to int8 per block of 32 and an
integer dot product in a native kernel, whose extra rows cost a fraction of the first (blocks and
prefills are cheap) and whose rows are independent (row-invariant). Elsewhere, or where that kernel
cannot be built, or with FASTFORWARD_INT4_KERNEL=pytorch, `Int4Linear`: PyTorch's CPU kernel
`torch._weight_int4pack_mm_for_cpu` with bfloat16 activations. torchao 0.18 has no int4 path for
x86 CPUs (its int4 formats need CUDA, or KleidiAI on Arm; its x86 CPU kernels are not in its wheels).

PyTorch's int4 kernel's time grows with every row (it dequantizes as it multiplies), which makes a
prompt's prefill slow: on a CPU with native bfloat16 arithmetic (AVX-512 BF16 or AMX), `Int4Linear`
layers also keep their weights dequantized to bfloat16 (2 more bytes per weight; not the output
layer's), and a prefill (`prefill_kernels`) multiplies by those. That is not row-invariant, and needs
not be: AR and every decoder start from the same prefill of the same prompt.

A layer whose shape the int4 kernel cannot take
(input width not a multiple of 32, output width not a multiple of 16) is quantized to int8 instead.

Every nn.Linear is replaced, the output projection included (its tie to the input embedding is
cut: the embedding lookup keeps float weights).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fastforward.cpu import fusion, padded_prefill, smoothing, w4a8
from fastforward.cpu.low_rank import LowRank, LowRankLinear, W4A8LowRankLinear
from fastforward.errors import FastForwardError

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32
DENSE_ROWS = 16  # fewer rows keep the int4 kernel, which is the faster one for a few rows


class _Prefill(threading.local):
    active = False


_prefill = _Prefill()


@contextmanager
def prefill_kernels() -> Iterator[None]:
    """Within it (this thread), int4 layers given at least `DENSE_ROWS` rows multiply by their
    dequantized bfloat16 weights, where they keep them. For prefills only: the result depends on the
    number of rows."""
    before, _prefill.active = _prefill.active, True
    try:
        yield
    finally:
        _prefill.active = before


def native_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (torch's private probes; absent ones answer no)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


class Int8Linear(nn.Module):
    """y = (q(x) @ W8ᵀ) · s_x · s_w: per-token int8 activations, per-channel int8 weights."""

    def __init__(self, linear: nn.Linear, smoothing: torch.Tensor | None = None):
        super().__init__()
        weight = linear.weight.detach().float()
        # x · Wᵀ = (x / s) · (W · s)ᵀ: the activations' outlier channels moved into the weights (`smoothing`)
        self.register_buffer("input_scale", None if smoothing is None else 1 / smoothing)
        if smoothing is not None:
            weight = weight * smoothing
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.input_scale is not None:
            rows = rows * self.input_scale
        # |x / s| <= 127 by construction of s, so no clamp is needed before the cast.
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        product = torch._int_mm(torch.round(rows / scale).to(torch.int8), self.weight_int8.t())
        y = (product * (scale * self.weight_scale)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Group-wise asymmetric int4 weights, bfloat16 activations (`_weight_int4pack_mm_for_cpu`)."""

    def __init__(self, linear: nn.Linear, dense: bool = False):
        """dense: also keep the weights dequantized to bfloat16, for prefills (`prefill_kernels`)."""
        super().__init__()
        out_features, in_features = linear.weight.shape
        groups = linear.weight.detach().float().reshape(out_features, -1, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        # The kernel computes (code - 8) · scale + zero, so zero = low + 8 · scale; layout [groups, out, 2].
        zero = low + 8 * scale
        scales_and_zeros = torch.stack([scale[..., 0].t(), zero[..., 0].t()], dim=-1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        dequantized = _dequantized(codes.reshape(groups.shape), scale, zero).reshape_as(codes) if dense else None
        self.register_buffer("dense", dequantized, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and _prefill.active:  # in a padded `--exact` prefill, each row alone
            apart = padded_prefill.each_row(self._multiply, x, self.out_features)
            if apart is not None:
                return apart
        return self._multiply(x)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.dense is not None and _prefill.active and rows.shape[0] >= DENSE_ROWS:
            y = nn.functional.linear(rows, self.dense).to(x.dtype)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """What the int4 kernel multiplies by, (code - 8) · scale + zero with its bfloat16 scales, in bfloat16."""
    return ((codes - 8) * scale.bfloat16().float() + zero.bfloat16().float()).bfloat16()


def _kind(in_features: int, out_features: int, scheme: str) -> type[nn.Module]:
    """int4 where its kernels take the shape (input widths in whole groups; output widths in multiples of 16
    for PyTorch's, any for the native one, which pads them), by the native kernel where it runs; int8
    otherwise, and for int8."""
    if scheme != "int4" or not w4a8.fits(in_features, w4a8.tiles(out_features)):
        return Int8Linear
    if w4a8.enabled():
        return w4a8.W4A8Linear
    return Int4Linear if w4a8.fits(in_features, out_features) else Int8Linear


def _quantized(linear: nn.Linear, scheme: str, smoothing: torch.Tensor | None, dense: bool) -> nn.Module:
    kind = _kind(linear.in_features, linear.out_features, scheme)
    if kind is Int8Linear:
        return Int8Linear(linear, smoothing)
    return w4a8.W4A8Linear(linear) if kind is w4a8.W4A8Linear else Int4Linear(linear, dense)


def _beside(linear: nn.Linear, update: LowRank, scheme: str, quantized: Callable, quantized_up: Callable) -> nn.Module:
    """`linear` quantized with `update` kept beside it (`fastforward.cpu.low_rank`): one native call where
    both its products take the native int4 kernel, else a `LowRankLinear` of the scheme's layers."""
    rank = update.padded().down.shape[0]
    kinds = {_kind(linear.in_features, linear.out_features + rank, scheme), _kind(rank, linear.out_features, scheme)}
    if kinds == {w4a8.W4A8Linear} and w4a8.fits(rank, linear.out_features):  # its packing takes whole tiles
        return W4A8LowRankLinear(linear, update)
    return LowRankLinear(linear, update, quantized, quantized_up)


def _fusable(layers: list[nn.Linear], scheme: str) -> bool:
    """Whether layers that read one input may run as one: where they and their concatenation get
    the same kernel (so the same bits), int8 or the native int4 one. PyTorch's int4 kernel measured
    no faster fused."""
    width = sum(layer.out_features for layer in layers)
    kinds = {_kind(layer.in_features, layer.out_features, scheme) for layer in layers}
    return kinds == {_kind(layers[0].in_features, width, scheme)} and kinds != {Int4Linear}


def uses_int8(hf: nn.Module, scheme: str) -> bool:
    """Whether quantizing `hf` with `scheme` gives it int8 layers (int8, or int4's misfits)."""
    linears = [m for m in hf.modules() if isinstance(m, nn.Linear)]
    return scheme != "none" and any(_kind(m.in_features, m.out_features, scheme) is Int8Linear for m in linears)


def check_scheme(scheme: str) -> None:
    if scheme not in QUANTIZATIONS:
        raise FastForwardError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZATIONS)}")


def keeps_adapters_apart(scheme: str) -> bool:
    """Whether an adapter is kept beside the weights quantized with `scheme` rather than merged into them:
    int4 rounds a merged adapter away (`fastforward.cpu.low_rank`); int8 keeps most of it, at no cost."""
    return scheme == "int4"


def quantize(
    hf: nn.Module,
    scheme: str,
    fuse: bool = True,
    calibration: list[list[int]] | None = None,
    low_rank: dict[str, LowRank] | None = None,
) -> None:
    """Replace every nn.Linear of `hf` in place ("none" leaves it as it is). CPU only: the kernels
    are PyTorch's CPU integer kernels. fuse: int8 and native int4 layers that read the same input
    become one layer (`fastforward.cpu.fusion`; the same bits, fewer calls). calibration: token ids whose forwards set
    the int8 layers' smoothing (`fastforward.cpu.smoothing`); None quantizes them unsmoothed.
    low_rank: adapters' updates by layer name, kept beside the quantized weights (`fastforward.cpu.low_rank`)."""
    check_scheme(scheme)
    low_rank = low_rank or {}
    if scheme == "none":
        if low_rank:
            raise FastForwardError("adapter updates are kept apart only beside quantized weights; merge them instead")
        return
    device = next(hf.parameters()).device
    if device.type != "cpu":
        raise FastForwardError(
            f"--quantize {scheme} runs on the CPU only (the model is on {device}): use --quantize none"
        )
    _untie_output(hf)
    if not uses_int8(hf, scheme):  # int4 throughout: nothing to smooth
        calibration = None
    groups = fusion.shared_input_groups(hf) if calibration or fuse else []
    factors = smoothing.smoothing_factors(hf, groups, calibration) if calibration else {}
    # an update's second factor reads the first's output: no smoothing, no bfloat16 copy
    up = functools.partial(_quantized, scheme=scheme, smoothing=None, dense=False)
    for members in groups:
        layers = [hf.get_submodule(name) for name in members]
        if not fuse or not _fusable(layers, scheme):
            continue
        build = functools.partial(_quantized, scheme=scheme, smoothing=factors.get(members[0]), dense=False)
        if not low_rank.keys().isdisjoint(members):  # the group's weights and updates as one layer (`_beside`)
            update = LowRank.side_by_side([low_rank.get(name) for name in members], [m.out_features for m in layers])
            build = functools.partial(_beside, update=update, scheme=scheme, quantized=build, quantized_up=up)
        fusion.fuse(hf, members, build)
    # The output layer reads a prefill's last rows only: its bfloat16 copy would sit unused.
    output, native = hf.get_output_embeddings(), native_bfloat16()
    for name, module in list(hf.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, attribute = name.rpartition(".")
            build = functools.partial(_quantized, scheme=scheme, smoothing=factors.get(name))
            if name in low_rank:
                layer = _beside(module, low_rank[name], scheme, functools.partial(build, dense=native), up)
            else:
                layer = build(module, dense=native and module is not output)
            setattr(hf.get_submodule(parent), attribute, layer)
    hf.config.fastforward_quantization = scheme


def _untie_output(hf: nn.Module) -> None:
    """Give the output projection its own copy of a tied embedding matrix, so that quantizing it
    leaves the embedding lookup in floating point."""
    output, inputs = hf.get_output_embeddings(), hf.get_input_embeddings()
    if output is not None and output.weight is inputs.weight:
        output.weight = nn.Parameter(inputs.weight.detach().clone(), requires_grad=False)
        hf.config.tie_word_embeddings = False
