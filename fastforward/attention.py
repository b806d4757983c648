"""Row-invariant attention: each query attends alone, over exactly the keys it may see, in key order.

A fused attention kernel computes a query's result differently depending on how many queries share
the call (block sizes, a different path for one query than for several), so a token's logits in a
16-token forward differ in the last bits from the same token's logits in a 1-token forward. With
int8 activations such a difference can flip a rounding and grow (measured on SmolLM2-135M: logits
up to 5.9 apart, a different argmax). Here each query of each row gathers the keys its mask allows,
in key order — for a verifying decoder that is the same key sequence greedy AR gives that token —
and runs the same small matmul / softmax / matmul as a 1-token forward would. Together with
`quantize.Int8Linear` (integer matmuls, per-token scales) a token's logits are then the same bits
whatever else shares its forward: verifying decoders give greedy AR's tokens exactly.

It costs a few small operations per query and layer on every forward against a cache, so it is
chosen (`load_model(..., exact=True)`) rather than always on. A prefill (no cache yet) runs SDPA:
AR and every decoder start from the same prefill of the same prompt, so it needs no invariance.
Registered with transformers' `AttentionInterface` as "fastforward_exact": no modeling file is touched.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
    if total == length:  # a prefill (nothing cached): shared by AR and every decoder, so SDPA's speed is kept
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    attend = _opaque_attention if torch.compiler.is_compiling() else _attend  # same loop, same bits
    return attend(query, key, value, attention_mask, dim**-0.5 if scaling is None else scaling), None


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    batch, heads, length, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # [B, Hkv, groups, T, d]: the query heads that share each key/value head
    grouped = query.reshape(batch, kv_heads, groups, length, dim)
    out = query.new_empty(batch, length, heads, dim)
    for b in range(batch):
        for t in range(length):
            if attention_mask is None:
                keys, values = key[b, :, : total - length + t + 1], value[b, :, : total - length + t + 1]
            else:
                visible = attention_mask[b, 0, t]  # boolean: fastforward's layouts and `sdpa_mask` both give one
                keys, values = key[b][:, visible], value[b][:, visible]
            scores = torch.matmul(grouped[b, :, :, t], keys.transpose(-1, -2)) * scale  # [Hkv, groups, S_t]
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            out[b, t] = torch.matmul(probs, values).reshape(heads, dim)
    return out


@torch.library.custom_op("fastforward::row_invariant_attention", mutates_args=())
def _opaque_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`_attend` as one operation that torch.compile does not look into: its per-query loop would
    otherwise be unrolled into a graph per block length, and the compiled softmax and matmuls would
    no longer give a query the same bits whatever else shares the forward."""
    return _attend(query, key, value, attention_mask, scale)


@_opaque_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float):
    batch, heads, length, dim = query.shape
    return query.new_empty(batch, length, heads, dim)


AttentionInterface.register(NAME, row_invariant_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # boolean masks, as for SDPA
