"""FlexAttention for every layout: the layout's visibility as a `BlockMask`.

With a dense boolean mask SDPA on a GPU falls back from its fused flash kernel to one that reads
every query-key pair; an SBD training row is 2L tokens with a [2L, 2L] mask of which about a
quarter is visible. FlexAttention skips the 128 × 128 tiles a `BlockMask` marks empty and runs the
rest in one fused kernel. Any rule of `fastforward.model.visibility` (training or decoding, with or
without a cache) reaches it the same way: its dense visibility [B, T, P + T] is looked up by the
`mask_mod`, so a new rule needs nothing here.

Measured on an H200 (benchmarks/gpu_check.py, docs/results.md "GPU"): training SmolLM2-135M,
FlexAttention runs at SDPA's speed with less memory; a decoding step, which builds a new BlockMask
each time, is slower than SDPA's. So training on CUDA takes it by default (`for_training`) and
decoding only when asked (`--attention flex`).

On CUDA the kernel is compiled (Triton); elsewhere flex_attention runs its unfused reference
implementation, which has a forward but no backward on the CPU in torch 2.13 (tests compare it
with SDPA there).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from accelerate.utils import parse_flag_from_env
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flex_attention_mask

from fastforward.errors import FastForwardError

NAME = "fastforward_flex"
CHOICES = ("sdpa", "flex")


class FlexUnsupported(FastForwardError):
    """A model FlexAttention cannot run yet (sliding-window layers): `train --attention auto` then takes SDPA."""


def implementation(attention: str) -> str:
    """The transformers attention implementation of an `--attention` choice."""
    if attention not in CHOICES:
        raise FastForwardError(f"unknown attention {attention!r}; choose one of {', '.join(CHOICES)}")
    return NAME if attention == "flex" else "sdpa"


def for_training(attention: str, objective: str) -> str:
    """`fastforward train --attention auto`: flex on a CUDA GPU for the objectives whose layouts are masks
    (the same speed as SDPA's dense masks and less memory, docs/results.md "GPU"), SDPA for NTP (its
    causal flash kernel is faster there) and on every other device, the CPU that
    ACCELERATE_USE_CPU asks for beside a GPU included."""
    if attention != "auto":
        return attention
    on_gpu = torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")
    return "flex" if on_gpu and objective != "ntp" else "sdpa"


def block_mask(visibility: torch.Tensor | None, batch: int, length: int, past: int, device: torch.device) -> BlockMask:
    """The BlockMask of a forward of `length` new tokens after `past` cached entries.

    visibility: the layout's [B, T, P + T] booleans, or None for plain causal attention over
    unpadded rows (the query at i sees keys up to past + i)."""
    if visibility is None:
        offset = torch.tensor(past, device=device)  # a tensor, not an int the compiled kernel would guard on

        def causal(b, h, q, kv):
            return kv <= q + offset

        return create_block_mask(causal, None, None, length, past + length, device=device)

    def lookup(b, h, q, kv):
        return visibility[b, q, kv]

    return create_block_mask(lookup, visibility.shape[0], None, length, past + length, device=device)


_compiled: Callable | None = None


def _kernel(device: torch.device) -> Callable:
    """flex_attention compiled once per process on CUDA (fused Triton kernels, forward and backward)."""
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def flex_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, H, T, d]; key, value [B, Hkv, S, d]; attention_mask a BlockMask (`block_mask`) or None
    (causal, the last T keys being the queries'). Returns [B, T, H, d]."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise FastForwardError("fastforward's FlexAttention has no logit soft-capping or attention sinks; use sdpa")
    if dropout > 0:
        raise FastForwardError("FlexAttention has no attention dropout; set the model's attention_dropout to 0")
    length, total = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = block_mask(None, query.shape[0], length, total - length, query.device)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and groups & (groups - 1):  # as transformers does: GQA in the kernel wants a power of two
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _kernel(query.device)(
            query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, flex_attention_forward)
AttentionMaskInterface.register(NAME, flex_attention_mask)  # for callers that pass 2D padding masks
