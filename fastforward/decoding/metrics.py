"""Metrics defined once (see DESIGN.md, Metrics): TPF, speedup, AUP, and agreement between two outputs.

- TPF: generated tokens ÷ decoding forwards.
- Speedup: TPS ÷ TPS of AR decoding of the same model, engine, hardware and prompts, same run.
- AUP (accuracy under parallelism, from the d3LLM / MBD papers): see `aup`.
- Agreement: how far a decoder's token ids match a reference output (e.g. the same model's greedy AR
  output on the same prompt): see `token_agreement`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from fastforward.errors import FastForwardError

DROP_BELOW = 5.0  # AUP ignores points more than this many accuracy points below the first one
SHARPNESS = 3.0  # AUP's weight W(y) = min(exp(-SHARPNESS * (1 - y / y_max)), 1)


def tpf(tokens: int, forwards: int) -> float:
    """Tokens per forward: generated tokens ÷ decoding forwards (prefill not counted). Tokens that all came
    from the prefill (a one-token answer: no decoding forward) count as one forward's, so they read 1.0, not 0;
    nothing generated reads 0. The one definition: every report, API usage and metric takes it from here."""
    return tokens / max(forwards, 1)


def queries_per_token(queries: int, tokens: int) -> float:
    """Tokens the decoding forwards ran ÷ generated tokens: what a decoder's TPF costs in work (AR: just
    under 1, its first token coming from the prefill); 0 when nothing was generated."""
    return queries / tokens if tokens else 0.0


class Rates:
    """TPF, TPS and queries per token of anything that counts its generated tokens, decoding forwards,
    wall seconds and queries: a row's `Stats` and an evaluation's `EvalResult` read them from here, so
    the two report the same figure the same way."""

    tokens: int
    nfe: int
    seconds: float
    queries: int

    @property
    def tpf(self) -> float:
        return tpf(self.tokens, self.nfe)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def queries_per_token(self) -> float:
        return queries_per_token(self.queries, self.tokens)


def speedup(tps: float, tps_ar: float) -> float:
    """Throughput relative to AR decoding measured in the same run; 0 when the AR figure is missing."""
    return tps / tps_ar if tps_ar > 0 else 0.0


def aup_weight(y: float, y_max: float) -> float:
    """W(y) = min(exp(-3 (1 - y / y_max)), 1): 1 at (or above) y_max, decaying as accuracy drops."""
    if y_max <= 0:
        return 1.0
    return min(math.exp(-SHARPNESS * (1.0 - y / y_max)), 1.0)


def aup(points: Iterable[tuple[float, float]], y_max: float | None = None) -> float:
    """Accuracy under parallelism of a curve of (TPF ρ, accuracy y in %) points.

    The points are sorted by ρ (ties: higher accuracy first); y₁ is the accuracy at the smallest ρ;
    points with y < y₁ − 5 are dropped. With W(y) = min(exp(−3·(1 − y/y_max)), 1):

        AUP = ρ₁·y₁·W(y₁) + Σᵢ₌₂ (ρᵢ − ρᵢ₋₁)·(yᵢ·W(yᵢ) + yᵢ₋₁·W(yᵢ₋₁)) / 2

    The first point is weighted too, as DESIGN.md defines it; d3LLM's public `get_aup` leaves it
    unweighted (../shared/REFERENCES.md), which scores a lone fast but inaccurate point at ρ·y. The two
    agree whenever y₁ = y_max.

    `y_max` defaults to the highest accuracy among the points (so a lone point, or the best point,
    has weight 1). Pass the best accuracy of everything being compared (e.g. the AR baseline's) to
    put several curves on one scale; points above it get weight 1.
    """
    pts = sorted(((float(r), float(y)) for r, y in points), key=lambda p: (p[0], -p[1]))
    if not pts:
        raise FastForwardError("AUP needs at least one (TPF, accuracy) point")
    for r, y in pts:
        if not (math.isfinite(r) and r > 0):
            raise FastForwardError(f"AUP needs positive, finite TPF values; got {r}")
        if not 0 <= y <= 100:
            raise FastForwardError(f"AUP needs accuracies in percent (0 to 100); got {y}")
    if y_max is None:
        y_max = max(y for _, y in pts)
    elif y_max < 0:
        raise FastForwardError(f"y_max must be a non-negative accuracy in percent, got {y_max}")
    y1 = pts[0][1]
    kept = [(r, y) for r, y in pts if y >= y1 - DROP_BELOW]

    def f(y: float) -> float:
        return y * aup_weight(y, y_max)

    total = kept[0][0] * f(kept[0][1])
    for (r0, y0), (r1, y1_) in zip(kept, kept[1:], strict=False):
        total += (r1 - r0) * (f(y1_) + f(y0)) / 2
    return total


def token_agreement(a_ids: Sequence[int], b_ids: Sequence[int]) -> tuple[bool, float]:
    """(the two id sequences are identical, matching positions ÷ the longer length).

    Positions are compared one to one from the start; two empty sequences agree fully (True, 1.0).
    Accepts lists or 1-D tensors."""
    a, b = [int(t) for t in a_ids], [int(t) for t in b_ids]
    longest = max(len(a), len(b))
    if longest == 0:
        return True, 1.0
    same = sum(x == y for x, y in zip(a, b, strict=False))
    return a == b, same / longest
