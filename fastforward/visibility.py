"""Boolean attention rules: True where a query may attend to a key.

Rules over the new tokens of a forward are [T, T] matrices shared by the batch; `against_cache`
adds the cached keys and per-row padding to give the dense [B, T, P + T] mask SDPA takes.
"""

from __future__ import annotations

import torch


def causal(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Each token sees itself and everything before it."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def sbd_train(length: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """SBD training rule over `[clean x ; masked copy]` (2·length tokens, paper Fig. 8/9).

    clean→clean causal; masked→clean only keys in strictly earlier blocks; masked↔masked within the
    same block (bidirectional); clean never sees the masked copy.
    """
    idx = torch.arange(length, device=device)
    blocks = idx // block
    top_left = idx[None, :] <= idx[:, None]
    bottom_left = blocks[:, None] > blocks[None, :]
    bottom_right = blocks[:, None] == blocks[None, :]
    top = torch.cat([top_left, torch.zeros_like(top_left)], dim=1)
    bottom = torch.cat([bottom_left, bottom_right], dim=1)
    return torch.cat([top, bottom], dim=0)


def sbd_decode(commit: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """SBD decoding rule over `[finished block (commit) ; block being decoded]`.

    The committed tokens are causal among themselves (so their cache entries equal a causal
    prefill's); the decoded block sees every committed token and itself bidirectionally.
    """
    n = commit + block
    rule = torch.zeros(n, n, dtype=torch.bool, device=device)
    rule[:commit, :commit] = causal(commit, device)
    rule[commit:, :] = True
    return rule


def against_cache(rule: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """Dense mask [B, T, P + T] for `rule` over T new tokens after P cached entries.

    key_valid [B, P + T] marks real (non-padding) keys. Every query also sees itself, so padded
    queries never have an empty row (SDPA would return NaN there and poison the cache).
    """
    total, new = key_valid.shape[1], rule.shape[0]
    past = total - new
    cached = key_valid[:, None, :past].expand(-1, new, -1)
    fresh = rule[None] & key_valid[:, None, past:]
    fresh = fresh | torch.eye(new, dtype=torch.bool, device=rule.device)[None]
    return torch.cat([cached, fresh], dim=2)
