"""Attention with logit soft-capping (Gemma 2), which SDPA cannot apply: scores = c · tanh(scores / c).

transformers' own eager attention adds a boolean mask instead of applying it (silently wrong with the
dense masks every layout passes), so fastforward registers its own two functions with transformers'
`AttentionInterface`, and `load_model` picks one for a model whose config sets
`attn_logit_softcapping`:

- `NAME`: the eager computation, with masked scores set to -inf before the softmax;
- `EXACT`: the same per query, over exactly the keys it sees, so that its result is the same bits
  whatever else shares the forward (`--exact`; a prefill, shared by AR and every decoder, runs each
  row of a padded batch alone: `fastforward.cpu.padded_prefill`).

Both cost more than SDPA's fused kernel: the scores are materialised, and `EXACT` makes one small call
per query and layer (figures: docs/results.md, "Precision and exactness").
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fastforward.cpu.padded_prefill import attend_rows_apart
from fastforward.errors import FastForwardError

NAME = "fastforward_softcap"
EXACT = "fastforward_softcap_exact"


def _scores(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """query [..., T, d] over key, value [..., S, d] where `visible` [..., T, S] (None: all) holds → [..., T, d]."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(value.dtype)  # a query that sees nothing: 0
    return torch.matmul(weights, value)


def _prepare(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, **kw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    if kw.get("s_aux") is not None:
        raise FastForwardError("attention sinks are not supported with soft-capped attention")
    if kw.get("softcap") is None:
        raise FastForwardError(f"{NAME} serves soft-capped attention only; load the model through load_model")
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    length, total = query.shape[2], key.shape[2]
    if mask is None:  # causal: the last `length` keys are the queries'
        mask = torch.ones(length, total, dtype=torch.bool, device=query.device).tril(total - length)[None, None]
    elif mask.dtype != torch.bool:
        raise FastForwardError("soft-capped attention takes boolean masks")
    return key, value, mask[..., :total], kw["softcap"]


def softcap_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, T, d]; key, value [B, Hkv, S, d]; attention_mask bool [B, 1, T, S] or None (causal)."""
    key, value, mask, cap = _prepare(query, key, value, attention_mask, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _scores(query, key, value, mask, scale, cap).transpose(1, 2).contiguous(), None


def exact_softcap_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`softcap_attention` one query at a time over the keys it sees, in key order (row-invariant)."""
    if query.shape[2] == key.shape[2]:  # a prefill: shared by AR and every decoder, each row alone in a batch
        return attend_rows_apart(
            softcap_attention, module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    key, value, mask, cap = _prepare(query, key, value, attention_mask, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.empty_like(query)
    mask = mask.expand(query.shape[0], 1, -1, -1)
    for b in range(query.shape[0]):
        for t in range(query.shape[2]):
            seen = mask[b, 0, t].nonzero().squeeze(1)
            out[b, :, t] = _scores(query[b, :, t : t + 1], key[b][:, seen], value[b][:, seen], None, scale, cap)[:, 0]
    return out.transpose(1, 2).contiguous(), None


for name, function in ((NAME, softcap_attention), (EXACT, exact_softcap_attention)):
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)  # boolean masks, as for SDPA


def attention_for(config, exact: bool) -> str | None:
    """The attention implementation a config needs that SDPA cannot give, or None."""
    if getattr(config, "attn_logit_softcapping", None) is None:
        return None
    return EXACT if exact else NAME
