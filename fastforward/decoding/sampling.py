"""Turning logits into tokens: greedy, or sampled at a temperature within the top-p mass.

**Randomness is keyed, not streamed.** The token a row samples at position i (counted from the
start of its prompt) uses one uniform draw u(key, i), a hash of the row's key and i: no generator
state, so a row draws the same numbers whatever shares its batch, and however many forwards,
drafts or reveal steps led to position i. A row's key hashes its seed with its prompt's tokens
(`row_key`). The token is the inverse CDF of the sampling distribution p (softmax(logits / T),
cut to the top-p mass) at u.

**Verification by sampling is then exact.** A verifying decoder samples a target at every position
it reads, with that position's own draw, and keeps a draft while it equals the target. For a draft
x that does not depend on the draw (n-gram drafts, a mask model's), this is speculative rejection
sampling with a one-hot draft: x is accepted with probability p(x), and on rejection the target is
distributed as p with x removed and renormalised. Either way the token committed at i is the inverse
CDF at u(key, i) of p given the committed text before i: the very token AR sampling with the same
seed commits. Drafts sampled with the same draws (Jacobi's carried predictions) agree with their
targets more often, and the output is still exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from fastforward.options import NON_NEGATIVE, SHARE, check_options, option

_M32 = 0xFFFFFFFF
_DRAFTS = 0x9E3779B9  # sets random drafts' draws apart from sampling's
_Bits = TypeVar("_Bits", int, torch.Tensor)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most probable token of logits [..., V] → [...], the first one on a tie (as argmax).

    `max(...).indices` rather than `argmax`: on CPU it is faster over a vocabulary, with the same
    first-maximum rule (tests/test_policies.py).
    Every greedy choice in fastforward goes through here, so all decoders break ties alike.
    """
    return logits.max(dim=-1).indices


def row_key(seed: int, *tokens: Sequence[int]) -> int:
    """A row's 32-bit key for its random draws: its seed hashed with its prompt's token lists (the
    same on every run and machine, unlike Python's `hash`)."""
    text = repr((int(seed), *([int(t) for t in part] for part in tokens))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


def _mix(x: _Bits) -> _Bits:
    """A 32-bit integer hash (Wellons' lowbias32) of 32-bit values: ints, or int64 tensors. Both
    multipliers are below 2^31, so no int64 product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def uniforms(keys: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Uniform draws in (0, 1) [B, ...] (float64, 32 random bits) for positions `at` [B, ...] of the
    rows with `keys` [B]: a function of (key, position) alone, computed on the device without a sync."""
    key = keys.view(-1, *([1] * (at.dim() - 1)))
    bits = _mix(key ^ _mix(at.long() & _M32))
    return (bits.double() + 0.5) / 2.0**32


def random_tokens(key: int, positions: Iterable[int], vocab: int) -> list[int]:
    """Random ids in [0, vocab) for draft slots at RoPE `positions` of the row with `key`: like every
    draw here a function of (key, position) alone, apart from the sampling draws, so a row's random
    drafts do not depend on its batch, its slot in it, or how many steps led to a slot."""
    stream = _mix(key ^ _DRAFTS)
    return [(_mix(stream ^ _mix(p & _M32)) * vocab) >> 32 for p in positions]


@dataclass(frozen=True)
class Sampler:
    """How a row chooses tokens (`BatchSampler`): temperature 0 is greedy (argmax); otherwise
    softmax(logits / T) within the top-p mass is sampled with each row's draw for each position."""

    temperature: float = option(0.0, "sampling temperature (0 = greedy)", NON_NEGATIVE)
    top_p: float = option(1.0, "nucleus sampling mass", SHARE)
    seed: int = option(0, "seed of sampling and of random draft initialisation")

    def __post_init__(self) -> None:
        check_options(self)

    def inverse_cdf(self, logits: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """The token of logits [..., V] whose share of the sampling distribution's CDF holds each
        draw [...] in (0, 1): a token outside the top-p mass has no share and is never chosen."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs > self.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        # the first token whose CDF passes the draw, scaled to the kept mass (so no renormalising)
        return torch.searchsorted(cdf, (draws * cdf[..., -1])[..., None], right=True)[..., 0]


class _Sampled(Protocol):
    """What a batch's sampler reads of a row (`rows.Row`)."""

    sampler: Sampler
    key: int


class BatchSampler:
    """How the rows of a batch choose tokens (`Session.sampler`, built again when rows join or leave):
    each row greedy, or sampled by its own sampler with its draw for each position (a token's
    position keys its draw; greedy ignores it). Rows of different samplers are sampled group by group,
    each row as it would be alone."""

    def __init__(self, rows: Sequence[_Sampled], device: torch.device):
        rows_of: dict[tuple[float, float], list[int]] = {}
        for index, row in enumerate(rows):
            if row.sampler.temperature > 0:
                rows_of.setdefault((row.sampler.temperature, row.sampler.top_p), []).append(index)
        # each row's key (`rows.Row.key`), and the samplers at temperature > 0 with their rows (None: all)
        self.keys = torch.tensor([row.key for row in rows], device=device) if rows_of else None
        self.groups: list[tuple[Sampler, torch.Tensor | None]] = [
            (rows[indices[0]].sampler, None if len(indices) == len(rows) else torch.tensor(indices, device=device))
            for indices in rows_of.values()
        ]

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens [B, ...] for logits [B, ..., V], the tokens to sit at RoPE `positions` [B, ...]."""
        if self.keys is None:
            return greedy(logits)
        draws = uniforms(self.keys, positions)
        if len(self.groups) == 1 and self.groups[0][1] is None:  # every row alike
            return self.groups[0][0].inverse_cdf(logits, draws)
        tokens = greedy(logits)
        for sampler, rows in self.groups:
            tokens[rows] = sampler.inverse_cdf(logits[rows], draws[rows])
        return tokens
