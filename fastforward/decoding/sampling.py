"""Turning logits into tokens: greedy, or temperature with optional nucleus (top-p) truncation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastforward.errors import FastForwardError


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most probable token of logits [..., V] → [...], the first one on a tie (as argmax).

    `max(...).indices` rather than `argmax`: on CPU it is about 3x faster over a vocabulary
    (16 x 49152 logits: 185 vs 589 us), with the same first-maximum rule (tests/test_policies.py).
    Every greedy choice in fastforward goes through here, so all decoders break ties alike.
    """
    return logits.max(dim=-1).indices


@dataclass
class Sampler:
    """temperature 0 is greedy (argmax); otherwise sample softmax(logits / T) within the top-p mass."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise FastForwardError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FastForwardError(f"top_p must be in (0, 1], got {self.top_p}")

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens for logits [..., V]; returns [...]."""
        if self.temperature == 0:
            return greedy(logits)
        if self._generator is None or self._generator.device != logits.device:
            self._generator = torch.Generator(device=logits.device).manual_seed(self.seed)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs > self.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self._generator).reshape(probs.shape[:-1])
