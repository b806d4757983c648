"""Sliding-window attention layers (Mistral, Gemma 2/3, Cohere2, Qwen2 with `use_sliding_window`, ...):
which layers slide, and their masks, built from RoPE positions.

A sliding layer's query at position p sees only the keys at positions p - w + 1 .. p (transformers'
rule, `kv_idx > q_idx - w`, stated on positions rather than on cache slots). fastforward's layouts put
tokens at repeated or out-of-order positions and keep cache entries in any order (Set Diffusion
commits in reveal order), so the window is applied to each key's RoPE position, which the cache
records beside its entries (`cache.track_positions`). Every layer keeps all its entries (`new_cache`):
the masks, not the cache, hide what a sliding layer may no longer see, so `keep` and rolling back
work as for full attention.

A model whose layers all slide gets one windowed mask; a model that mixes sliding and full layers
gets transformers' per-kind mapping {"full_attention": ..., "sliding_attention": ...}.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from fastforward.errors import FastForwardError

KINDS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class SlidingWindow:
    size: int  # w: a query sees the keys of the last w positions, its own included
    mixed: bool  # some layers attend in full: masks go as a mapping by layer kind


def sliding_window(hf: PreTrainedModel) -> SlidingWindow | None:
    """The model's sliding window, None when no layer slides; unsupported layer kinds are refused."""
    config = hf.config
    size = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds:
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise FastForwardError(
                f"{type(hf).__name__} has layers of kind {', '.join(unknown)}, which fastforward does not run yet "
                f"(it runs {' and '.join(KINDS)} layers); use a model without them"
            )
        if "sliding_attention" not in kinds:
            return None
        mixed = "full_attention" in kinds
    elif not size:
        return None
    else:
        mixed = False  # no per-layer kinds: every layer slides (Mistral, Mixtral, Phi-3, Starcoder2)
    if not size or size < 1:
        raise FastForwardError(f"{type(hf).__name__} has sliding layers but a window of {size!r}: fix its config")
    if mixed and "attention_mask, dict)" not in inspect.getsource(type(hf.get_decoder()).forward):
        raise FastForwardError(
            f"{type(hf).__name__} mixes sliding and full attention layers but takes no mask per layer kind, "
            "so fastforward cannot give each kind its own mask; use a model whose transformers implementation "
            "accepts a mapping of masks (Gemma 2/3, Qwen2, Cohere2, ...)"
        )
    return SlidingWindow(int(size), mixed)


def masks(
    window: SlidingWindow, visibility: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention masks of a layout: visibility [B, T, S] as it is for full layers, and restricted to
    keys less than `window.size` positions behind the query for sliding ones ([B, 1, T, S] each)."""
    behind = query_positions[:, :, None] - key_positions[:, None, :]
    sliding = (visibility & (behind < window.size))[:, None]
    return {"full_attention": visibility[:, None], "sliding_attention": sliding} if window.mixed else sliding
