"""Which masked positions of a block to reveal after a forward pass.

Every policy sorts the still-masked positions by a per-token score and reveals the longest
prefix of that order whose running statistic stays within a bound (always at least one token
while any is masked). The statistics come from the whole predicted distribution, never from the
sampled token. A policy's bound is an option (`fastforward.options`), checked when the policy is made,
so `EntropyBounded(-1.0)` is refused as `--gamma -1` is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass

import torch

from fastforward.errors import FastForwardError
from fastforward.options import NON_NEGATIVE, check_options, option

# A reveal policy: (logits [B, k, V], masked [B, k]) → the positions to reveal [B, k] (a subset of `masked`).
Policy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) over the last axis."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (-(logp.exp() * logp).sum(dim=-1)).clamp_min(0.0)


def entropy_and_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy (nats) and max probability of softmax(logits) over the last axis."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return (-(p * logp).sum(dim=-1)).clamp_min(0.0), p.amax(dim=-1)


def bound(help: str) -> float:
    """A policy's bound, the value `--gamma` sets: a dataclass field without a default, >= 0."""
    return option(MISSING, help, NON_NEGATIVE, kind=float)


@dataclass(frozen=True)
class _Bounded:
    """A policy whose bound is checked when it is made, however it is made."""

    def __post_init__(self) -> None:
        check_options(self)


def _reveal(
    score: torch.Tensor,
    masked: torch.Tensor,
    descending: bool,
    within_bound: Callable[[torch.Tensor], torch.Tensor],
    stat: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reveal, per row, the first n masked positions in `score` order (best first).

    `within_bound` maps `stat` (default: the score itself) laid out in that order to a monotone
    mask (True, then False); n is its count, at least 1 where the row still has masked positions.
    Each step runs right after a forward, when every small tensor op is slow: keep them few.
    """
    key = (-score if descending else score).masked_fill(~masked, math.inf)
    ordered, order = key.sort(dim=-1, stable=True)  # masked positions first, best first
    if stat is None:
        # The score's own values, in order; positions not masked carry ±inf, which fails every bound.
        within = within_bound(-ordered if descending else ordered)
    else:
        within = within_bound(stat.gather(-1, order)) & masked.gather(-1, order)
    count = within.sum(-1).clamp_min(1)
    return (order.argsort(dim=-1) < count[:, None]) & masked


@dataclass(frozen=True)
class EntropyBounded(_Bounded):
    """EB-Sampler with entropy proxy (SBD eq. 8): lowest entropy first, while Σ_{j<s} H_j ≤ γ."""

    gamma: float = bound("entropy budget γ")

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return self.by_entropy(entropy(logits), masked)

    def by_entropy(self, h: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        # Past the masked positions the entropies are inf: inf - inf is nan, outside the bound.
        return _reveal(h, masked, False, lambda e: e.cumsum(-1) - e <= self.gamma)


@dataclass(frozen=True)
class EntropyLeftmost(EntropyBounded):
    """EntropyBounded, except when no masked position is confident (its lowest entropy above γ): then
    the leftmost masked position, whose prediction sees the most of the block filled (AR's choice
    once the positions before it are), instead of the lowest-entropy one far to its right."""

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        h = entropy(logits)
        reveal = self.by_entropy(h, masked)
        unsure = h.masked_fill(~masked, math.inf).amin(dim=-1, keepdim=True) > self.gamma
        leftmost = masked & (masked.cumsum(dim=-1) == 1)
        return torch.where(unsure, leftmost, reveal)


@dataclass(frozen=True)
class EntropyPrefix(_Bounded):
    """A run from the leftmost masked position while Σ_{j≤s} H_j ≤ γ (at least one), so every revealed
    token has its left filled, as a causal model's would (the state SBD's `suffix_share` rows train).
    The bound counts the last token's own entropy, unlike EB's Σ_{j<s}: in entropy order that last one
    is the surest left, in position order it could be the least sure."""

    gamma: float = bound("entropy budget γ")

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        place = torch.arange(masked.shape[-1], device=masked.device).expand(masked.shape).float()
        return _reveal(place, masked, False, lambda e: e.cumsum(-1) <= self.gamma, stat=entropy(logits))


@dataclass(frozen=True)
class ConfidenceBounded(_Bounded):
    """EB-Sampler with confidence proxy (SBD eq. 18): most confident first, while Σ H − max H ≤ γ."""

    gamma: float = bound("entropy budget γ beyond the surest position's")

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        entropy, confidence = entropy_and_confidence(logits)
        return _reveal(
            confidence, masked, True, lambda h: h.cumsum(-1) - h.cummax(-1).values <= self.gamma, stat=entropy
        )


@dataclass(frozen=True)
class Factor(_Bounded):
    """Fast-dLLM's factor rule: most confident first, the largest n with (n + 1)(1 − c_(n)) < f."""

    factor: float = bound("factor f")

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        _, confidence = entropy_and_confidence(logits)
        n = torch.arange(1, confidence.shape[-1] + 1, device=confidence.device)
        return _reveal(confidence, masked, True, lambda c: (n + 1) * (1 - c) < self.factor)


@dataclass(frozen=True)
class Threshold(_Bounded):
    """Reveal every masked position whose confidence is at least τ (at least the most confident one)."""

    threshold: float = bound("confidence threshold τ")

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        _, confidence = entropy_and_confidence(logits)
        return _reveal(confidence, masked, True, lambda c: c >= self.threshold)


POLICIES = {
    "entropy": EntropyBounded,
    "entropy-left": EntropyLeftmost,
    "entropy-prefix": EntropyPrefix,
    "confidence": ConfidenceBounded,
    "factor": Factor,
    "threshold": Threshold,
}


def make_policy(name: str, value: float) -> Policy:
    """Build a policy by name; `value` is γ (entropy, confidence), f (factor) or τ (threshold), checked
    by the policy itself."""
    if name not in POLICIES:
        raise FastForwardError(f"unknown reveal policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](value)


def most_confident(confidence: Sequence[float], among: Iterable[int]) -> int:
    """The index among `among` whose confidence is highest, the first on a tie (as `sampling.greedy`
    breaks its ties): the position a mask decoder reveals when none passes its threshold."""
    return max(among, key=lambda i: (confidence[i], -i))


def greedy_prefix(drafts, predictions):
    """How many leading drafts equal the prediction made just before each.

    The acceptance rule of every verifying decoder: with greedy predictions, drafts confirmed this
    way are exactly what greedy AR decoding would produce; with predictions sampled with each
    position's own draw, exactly what AR sampling would (speculative sampling with one-hot drafts,
    see `fastforward.decoding.sampling`). Tensors [..., n] give a count per row (tensor ops, no
    sync); token lists give an int (for decoders that decide on the host after one read-back).
    """
    if isinstance(drafts, torch.Tensor):
        return (drafts == predictions).long().cumprod(-1).sum(-1)
    count = 0
    for draft, prediction in zip(drafts, predictions, strict=False):  # predictions may run on
        if draft != prediction:
            break
        count += 1
    return count
