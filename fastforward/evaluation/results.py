"""What an evaluation returns: one decoder's figures over a task (`EvalResult`) and a knob swept over
values (`SweepResult`). The figures are defined in `fastforward.evaluation.evaluate`'s docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastforward.decoding import metrics


@dataclass
class Timing(metrics.Rates):
    """The timed pass of `compare(timed=M)`: the first M examples again, at batch 1, interleaved with AR;
    its tokens per wall second are the result's TPS. same_tokens: how many of its M outputs equal the
    batched pass's (all of them where the decoder is batch invariant)."""

    n: int
    batch_size: int
    tokens: int
    nfe: int
    seconds: float
    prefill_seconds: float
    queries: int
    same_tokens: int

    def summary(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "batch_size": self.batch_size,
            "tokens": self.tokens,
            "nfe": self.nfe,
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "tps": round(self.tps, 3),
            "same_tokens": self.same_tokens,
        }


@dataclass
class EvalResult(metrics.Rates):
    """The figures of one decoder over a task's examples (defined in `evaluate`'s docstring). With a
    `timing` (a separate timed pass), TPS and speedup are that pass's; `seconds` stay this run's."""

    label: str
    decoder: str
    knobs: dict[str, Any]
    n: int
    accuracy: float  # percent
    score: float  # mean grader score in [0, 1]
    nfe: int  # decoding forwards, summed over examples
    tokens: int  # generated tokens, summed over examples
    seconds: float  # wall seconds of generation (prefill included)
    prefill_seconds: float
    batch_size: int = 1
    ar_tps: float | None = None
    ar_tpf: float | None = None
    agree_exact: float | None = None  # percent of outputs identical to the same model's greedy AR output
    agree_tokens: float | None = None  # mean token match rate with it, in [0, 1]
    tokens_per_step: dict[int, int] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list, repr=False)
    queries: int = 0  # tokens the decoding forwards ran, summed over examples (`runtime.Stats`)
    timing: Timing | None = None

    @property
    def tps(self) -> float:
        """Generated tokens per wall second: of the timed pass where there was one, else of this run."""
        return self.timing.tps if self.timing is not None else super().tps

    @property
    def nfe_mean(self) -> float:
        return self.nfe / self.n if self.n else 0.0

    @property
    def speedup(self) -> float | None:
        return None if self.ar_tps is None else metrics.speedup(self.tps, self.ar_tps)

    @property
    def nfe_speedup(self) -> float | None:
        return None if not self.ar_tpf else self.tpf / self.ar_tpf

    def summary(self) -> dict[str, Any]:
        """Every figure (no per-example records), JSON-ready."""

        def r(x: float | None, digits: int = 4) -> float | None:
            return None if x is None else round(x, digits)

        return {
            "label": self.label,
            "decoder": self.decoder,
            "knobs": self.knobs,
            "n": self.n,
            "batch_size": self.batch_size,
            "accuracy": r(self.accuracy, 3),
            "score": r(self.score),
            "nfe": self.nfe,
            "nfe_mean": r(self.nfe_mean, 3),
            "tokens": self.tokens,
            "tpf": r(self.tpf),
            "queries": self.queries,
            "queries_per_token": r(self.queries_per_token),
            "seconds": r(self.seconds),
            "prefill_seconds": r(self.prefill_seconds),
            "tps": r(self.tps, 3),
            "ar_tps": r(self.ar_tps, 3),
            "speedup": r(self.speedup),
            "nfe_speedup": r(self.nfe_speedup),
            "agree_exact": r(self.agree_exact, 3),
            "agree_tokens": r(self.agree_tokens),
            "tokens_per_step": {str(k): v for k, v in sorted(self.tokens_per_step.items())},
            "timed": None if self.timing is None else self.timing.summary(),
        }


@dataclass
class SweepResult:
    """A decoder knob swept over values: one EvalResult per value, the AR baseline, and AUP."""

    knob: str
    values: list[Any]
    points: list[EvalResult]
    baseline: EvalResult

    @property
    def curve(self) -> list[tuple[float, float]]:
        """(TPF, accuracy %) of each swept value, in the order given."""
        return [(p.tpf, p.accuracy) for p in self.points]

    @property
    def aup(self) -> float | None:
        """metrics.aup over the swept points (y_max: their best accuracy); None if a point has TPF 0."""
        curve = self.curve
        if not curve or any(tpf <= 0 for tpf, _ in curve):
            return None
        return metrics.aup(curve)

    def summary(self) -> dict[str, Any]:
        return {
            "knob": self.knob,
            "values": self.values,
            "aup": None if self.aup is None else round(self.aup, 4),
            "baseline": self.baseline.summary(),
            "points": [p.summary() for p in self.points],
        }
