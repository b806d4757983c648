"""Per-channel smoothing of int8 activations (SmoothQuant, Xiao et al. 2023), calibrated on built-in text.

A few input channels of a transformer's linear layers carry activations tens of times larger than
the rest. Quantizing each token's activations with one int8 scale then leaves the small channels a
handful of levels. Smoothing moves that range into the weights: an input channel j is divided by
s_j and the weight column j multiplied by it, s_j = max|x_j|^α / max|W_j|^(1-α) with α = 0.5, the
maxima of x taken over calibration text. The product is unchanged in exact arithmetic; the int8
rounding error is spread over both factors. On SmolLM2-135M it brings the int8 model's next-token
choices closer to the fp32 model's (`benchmarks/smoothing.py`,
docs/notes/2026-11-28-precision-and-batch-invariance.md).

Layers that read the same input share one s, computed over all their weights, so fused and separate
projections (`fastforward.cpu.fusion`) quantize identically. The division is one elementwise product
per token: a token's result still does not depend on what else shares its forward.

Calibration text: cuts of the Python standard library (the `pycode` task's train split, on every
machine with Python), prompt and continuation, eight of them, 128 tokens each: enough to find the
outlier channels, few enough to keep quantizing at load quick (`benchmarks/smoothing.py` times it).
"""

from __future__ import annotations

import torch
from torch import nn

ALPHA = 0.5  # SmoothQuant's migration strength, the paper's default
CALIBRATION_EXAMPLES = 8
CALIBRATION_TOKENS = 128  # per example


def calibration_ids(tokenizer) -> list[list[int]]:
    """Token ids of the calibration text (see the module docstring)."""
    from fastforward.tasks.pycode import PyCodeTask  # tasks import the model stack: keep this import local

    examples = PyCodeTask().examples("train", n=CALIBRATION_EXAMPLES)
    return [tokenizer(example.prompt + example.completion)["input_ids"][:CALIBRATION_TOKENS] for example in examples]


def smoothing_factors(hf: nn.Module, groups: list[list[str]], calibration: list[list[int]]) -> dict[str, torch.Tensor]:
    """s per input channel for every linear layer of `hf` (by name), from forwards of `calibration`;
    layers in one group of `groups` (the layers that read one input) share theirs."""
    linears = {name: module for name, module in hf.named_modules() if isinstance(module, nn.Linear)}
    maxima: dict[str, torch.Tensor] = {}

    def note(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            seen = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            maxima[name] = seen if name not in maxima else torch.maximum(maxima[name], seen)

        return hook

    hooks = [module.register_forward_pre_hook(note(name)) for name, module in linears.items()]
    device = next(hf.parameters()).device
    try:
        with torch.inference_mode():
            for ids in calibration:
                limit = getattr(hf.config, "max_position_embeddings", None) or len(ids)
                hf(input_ids=torch.tensor([ids[:limit]], device=device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    grouped = {name: members for members in groups for name in members}
    tiny = torch.finfo(torch.float32).tiny
    factors = {}
    for name in linears:
        members = grouped.get(name, [name])
        weight_max = torch.stack([linears[m].weight.detach().abs().amax(0).float() for m in members]).amax(0)
        seen = maxima.get(members[0])
        if seen is not None:  # a layer the calibration forwards never call is left as it is
            factors[name] = (seen.clamp_min(tiny) ** ALPHA / weight_max.clamp_min(tiny) ** (1 - ALPHA)).clamp_min(1e-5)
    return factors
