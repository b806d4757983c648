"""Boolean attention rules: True where a query may attend to a key.

Rules over the new tokens of a forward are [T, T] matrices shared by the batch (or [B, T, T], one
per row); `over_cache` adds the cached keys and per-row padding to give the dense [B, T, P + T] mask
SDPA takes: every attention mask of a forward, in training and decoding, is built there. Decoding
rules depend only on a few sizes, so they are built once per shape and shared (never mutate one).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from fastforward.errors import FastForwardError


@lru_cache(maxsize=256)
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


def multitf_train(length: int, block: int, groups: torch.Tensor) -> torch.Tensor:
    """MultiTF's group-aware dual-stream rule over `[clean x ; noisy copy]`, per row: [B, 2L, 2L].

    `groups` [B, blocks] numbers each block's noise-group (consecutive blocks, non-decreasing).
    clean→clean causal; clean never sees the copy; a copy token sees the clean tokens of earlier
    groups and the copy's blocks of its own group up to and including its own block. With every
    block its own group this is `sbd_train`.
    """
    idx = torch.arange(length, device=groups.device)
    blocks = idx // block
    group = groups[:, blocks]  # [B, L]
    top_left = (idx[None, :] <= idx[:, None]).expand(groups.shape[0], -1, -1)
    bottom_left = group[:, None, :] < group[:, :, None]
    bottom_right = (group[:, None, :] == group[:, :, None]) & (blocks[None, :] <= blocks[:, None])
    top = torch.cat([top_left, torch.zeros_like(top_left)], dim=2)
    bottom = torch.cat([bottom_left, bottom_right], dim=2)
    return torch.cat([top, bottom], dim=1)


def reveal_order(clean_rank: torch.Tensor, mask_rank: torch.Tensor) -> torch.Tensor:
    """Set Diffusion's rule over `[clean tokens ; masks]` by reveal order, per row: [B, N+M, N+M].

    clean_rank [B, N] is each clean token's place in the reveal order (distinct in a row); a mask
    of rank r [B, M] stands for a token revealed at r. A clean token sees the clean tokens revealed
    before it and itself; a mask sees the clean tokens revealed before its rank and itself; no
    mask sees another mask and no clean token sees a mask.
    """
    batch, n, m = clean_rank.shape[0], clean_rank.shape[1], mask_rank.shape[1]
    top = torch.cat(
        [clean_rank[:, None, :] <= clean_rank[:, :, None], clean_rank.new_zeros(batch, n, m, dtype=torch.bool)], dim=2
    )
    own = torch.eye(m, dtype=torch.bool, device=clean_rank.device).expand(batch, m, m)
    bottom = torch.cat([clean_rank[:, None, :] < mask_rank[:, :, None], own], dim=2)
    return torch.cat([top, bottom], dim=1)


@lru_cache(maxsize=256)
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


@lru_cache(maxsize=256)
def block_causal_decode(
    commit: int, blocks: tuple[int, ...], device: torch.device | str = "cpu", padding: int = 0
) -> torch.Tensor:
    """Multi-block decoding rule over `[finished blocks (commit) ; running blocks of these sizes ;
    padding]`.

    The committed tokens are causal among themselves (their cache entries equal a causal
    prefill's); a token of running block j sees every committed token, the running blocks before
    j, and its whole own block. With one running block this is `sbd_decode`. Padding tokens (a
    fixed-shape forward's unused slots) see only themselves and are seen by nothing else.
    """
    used = commit + sum(blocks)
    rule = torch.zeros(used + padding, used + padding, dtype=torch.bool, device=device)
    rule[:commit, :commit] = causal(commit, device)
    end = commit
    for size in blocks:
        end += size
        rule[end - size : end, :end] = True
    rule[used:, used:] = _identity(padding, torch.device(device))
    return rule


# Jacobi Forcing packs [prompt, noisy_1, clean_1, noisy_2, clean_2, ...]; what each token is:
PROMPT, NOISY, CLEAN = 0, 1, 2
CONTEXTS = ("noisy", "clean")  # what a noisy block sees of earlier blocks


def segments(prompt_len: int, block_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed token: its kind (PROMPT, NOISY, CLEAN) and block number (-1 in the prompt)."""
    kinds, numbers = [PROMPT] * prompt_len, [-1] * prompt_len
    for i, n in enumerate(block_lens):
        kinds += [NOISY] * n + [CLEAN] * n
        numbers += [i] * (2 * n)
    return torch.tensor(kinds), torch.tensor(numbers)


def jacobi_forcing_train(
    prompt_len: int, block_lens: Sequence[int], noisy_context: str = "noisy", device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[T, T] visibility of `[prompt, noisy₁, clean₁, …]` (True = query may attend to key).

    Within a segment (the prompt, one noisy block, one clean block): causal. Every block sees the
    whole prompt. clean_i sees clean_j for j < i. noisy_i sees noisy_j (noisy_context="noisy",
    Fig. 2b) or clean_j (noisy_context="clean", Fig. 2a) for j < i. Nothing else.
    """
    if noisy_context not in CONTEXTS:
        raise FastForwardError(f"unknown noisy context {noisy_context!r}; choose one of {', '.join(CONTEXTS)}")
    kind, number = (t.to(device) for t in segments(prompt_len, block_lens))
    q_kind, k_kind = kind[:, None], kind[None, :]
    q_num, k_num = number[:, None], number[None, :]
    same = (q_kind == k_kind) & (q_num == k_num) & causal(len(kind), device)
    prompt = (k_kind == PROMPT) & (q_kind != PROMPT)
    earlier = k_num < q_num
    clean = (q_kind == CLEAN) & (k_kind == CLEAN) & earlier
    seen = NOISY if noisy_context == "noisy" else CLEAN
    noisy = (q_kind == NOISY) & (k_kind == seen) & earlier
    return same | prompt | clean | noisy


def jacobi_candidates(chain: int, candidates: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Multi-block Jacobi rule over `[last token ; draft chain (chain - 1) ; candidate n-grams]`.

    The chain is causal; each candidate is causal within itself and sees the last token (slot 0),
    not the chain nor the other candidates.
    """
    total = chain + sum(candidates)
    rule = torch.zeros(total, total, dtype=torch.bool, device=device)
    rule[:chain, :chain] = True
    start = chain
    for length in candidates:
        rule[start : start + length, 0] = True
        rule[start : start + length, start : start + length] = True
        start += length
    return rule.tril()


def over_cache(rule: torch.Tensor, past: int, key_valid: torch.Tensor | None = None, batch: int = 1) -> torch.Tensor:
    """The dense mask [B, T, P + T] of T new tokens under `rule` ([T, T], or [B, T, T] per row) after
    P = `past` cached entries.

    key_valid [B, P + T] marks the real (non-padding) keys; every query then also sees itself, so a
    padded query never has an empty row (SDPA would return NaN there and poison the cache). None:
    every key is real, and a shared rule is expanded over `batch` rows (a view, nothing copied).
    """
    new = rule.shape[-1]
    if key_valid is None:
        mask = torch.cat([rule.new_ones(*rule.shape[:-1], past), rule], dim=-1)
        return mask.expand(batch, -1, -1) if mask.dim() == 2 else mask
    if key_valid.shape[1] != past + new:
        raise ValueError(f"key_valid covers {key_valid.shape[1]} keys, expected {past} cached + {new} new")
    mask = key_valid[:, None, :].expand(-1, new, -1).clone()
    mask[:, :, past:] &= rule
    mask[:, :, past:] |= _identity(new, rule.device)
    return mask


@lru_cache(maxsize=64)
def _identity(size: int, device: torch.device) -> torch.Tensor:
    return torch.eye(size, dtype=torch.bool, device=device)
