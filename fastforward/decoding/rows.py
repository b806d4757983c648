"""A session's rows: what a row is decoded from (`Prompt`), the row itself (`Row`), and what it gives
back (`Generation`, with its `Stats`).

A `Row` is one object per request, as nano-vLLM's `Sequence`: its prompt, its budget, its output
canvas and frontier, its stop state, its `status` (one field: waiting, running, or finished with its
reason), its counters, its sampler and seed, its timings, and `state`, which its decoder owns (a small
dataclass of the decoder's own). Rows joining and leaving a batch are list operations on
`Session.rows`; nothing is kept in parallel lists that would have to follow them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from fastforward.decoding import metrics
from fastforward.decoding.sampling import Sampler, row_key
from fastforward.errors import FastForwardError

if TYPE_CHECKING:
    from fastforward.model import Model


@dataclass
class Stats(metrics.Rates):
    """Per-prompt decoding figures. NFE counts decoding forwards only (prefill is separate).

    queries: the tokens those forwards ran through the model (AR: one per forward; drafts,
    candidates and masked positions add theirs). On a CPU a forward's cost grows with them, so
    queries per generated token says what a decoder's tokens per forward cost: just under 1.0 for
    AR, whose first token comes from the prefill."""

    nfe: int
    tokens: int
    seconds: float
    prefill_seconds: float
    tokens_per_step: dict[int, int] = field(default_factory=dict)
    queries: int = 0

    def as_dict(self) -> dict:
        return {
            "nfe": self.nfe,
            "tokens": self.tokens,
            "tpf": round(self.tpf, 4),
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "tps": round(self.tps, 3),
            "queries": self.queries,
            "queries_per_token": round(self.queries_per_token, 4),
            "tokens_per_step": {str(k): v for k, v in sorted(self.tokens_per_step.items())},
        }


@dataclass
class Generation:
    """One prompt's output: generated ids (prompt excluded, stop token included), text, stats, and
    why it ended (its row's `Status`): "stop" (a stop token, or a stop string the server cut it at),
    "length" (max_new_tokens, or an infilling gap filled), "context" (the model's context had no room
    for max_new_tokens after this prompt) or "cancelled" (`Row.finish`)."""

    token_ids: list[int]
    text: str
    stats: Stats
    finish_reason: str = "length"


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during decoding, carrying what each row had committed by then (finish_reason
    "interrupted" for the rows still running)."""

    def __init__(self, generations: list[Generation]):
        super().__init__()
        self.generations = generations


@dataclass(frozen=True)
class Prompt:
    """What one row is decoded from: a prefix, and for infilling a suffix `gap` positions after it.

    Without a suffix the row generates up to max_new_tokens after the prefix. With one, the row
    fills exactly the `gap` positions between them (its canvas), and the suffix is in the cache
    from the start, at its true positions. seed: the row's own sampling seed (None: its sampler's),
    so rows of one batch can be sampled apart (a request's seed, or many samples of one prompt).
    sampler: the row's own temperature and top-p (None: the session's), so requests that differ in
    them share a batch. ignore_eos: the row decodes through stop tokens up to its budget (a server
    request's `ignore_eos`, as benchmark clients send to fix output lengths).
    """

    prefix: Sequence[int]
    suffix: Sequence[int] = ()
    gap: int = 0
    seed: int | None = None
    sampler: Sampler | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.prefix:
            raise FastForwardError("a prompt is empty; give at least one token")
        if self.suffix and self.gap <= 0:
            raise FastForwardError(f"an infilling prompt needs a gap of at least 1 position, got {self.gap}")


class Status(Enum):
    """Where a row is: waiting for its prefill, running, or finished, as its reason (`Generation`)."""

    WAITING = "waiting"
    RUNNING = "running"
    STOP = "stop"
    LENGTH = "length"
    CONTEXT = "context"
    CANCELLED = "cancelled"


@dataclass(eq=False)  # a row is itself: callers may key on it
class Row:
    """One row of a session. The canvas holds its output keyed by position (index 0 is the first
    position after the prefix, at RoPE position `origin`; None: not committed yet); `frontier` counts
    its leading committed positions and `first_stop` is the position of its first committed stop token
    (`limit` if none). `limit` is its budget of canvas positions: the gap when infilling, else
    max_new_tokens or less where the model's context has no room (`context_bound`). `suffix` is an
    infilling row's suffix, which follows canvas position `limit - 1`. `status` is where it is: made
    `WAITING`, `RUNNING` once prefilled, then finished with its reason, which its own commits set
    (a stop token, its budget) or `finish` (between steps). `state` is its decoder's and `owner` its
    caller's (the server's job)."""

    prefix: list[int]
    suffix: list[int]
    limit: int
    sampler: Sampler
    stops: frozenset[int]
    seed: int | None = None
    context_bound: bool = False
    started: float = 0.0  # when its request began (perf_counter)
    prefill_seconds: float = 0.0
    frontier: int = 0
    status: Status = Status.WAITING
    forwards: int = 0  # decoding forwards it took part in
    queries: int = 0  # tokens those forwards ran
    committed: int = 0  # tokens committed since the step's forward (`Session.advance` logs them in `steps`)
    steps: dict[int, int] = field(default_factory=dict)  # steps it took part in that committed k tokens, by k
    state: Any = None
    owner: Any = None
    canvas: list[int | None] = field(init=False)
    first_stop: int = field(init=False)

    def __post_init__(self) -> None:
        self.canvas = [None] * self.limit
        self.first_stop = self.limit

    @property
    def origin(self) -> int:
        return len(self.prefix)

    @cached_property
    def key(self) -> int:
        """The key of its random draws (`sampling.row_key`): its own seed, else its sampler's, hashed
        with its prompt, so that what it draws depends on nothing else in its batch."""
        return row_key(self.sampler.seed if self.seed is None else self.seed, self.prefix, self.suffix)

    @property
    def finished(self) -> bool:
        return self.status is not Status.RUNNING and self.status is not Status.WAITING

    @property
    def length(self) -> int:
        """Its output length so far: its leading committed positions, up to its stop token."""
        return min(self.frontier, self.first_stop + 1)

    @property
    def output(self) -> list[int]:
        """Its committed tokens in position order, up to its stop token."""
        return self.canvas[: self.length]  # type: ignore[return-value]

    def write(self, writes: Sequence[tuple[int, int]]) -> int:
        """Put (position, token) pairs on the canvas (none once finished, none past the budget); then its
        frontier, first stop and status. Returns how many were written."""
        if self.finished:
            return 0
        canvas, limit, stops = self.canvas, self.limit, self.stops
        written = 0
        for position, token in writes:
            if 0 <= position < limit:
                canvas[position] = token
                written += 1
                if token in stops and position < self.first_stop:
                    self.first_stop = position
        frontier = self.frontier
        while frontier < limit and canvas[frontier] is not None:
            frontier += 1
        self.frontier = frontier
        self.committed += written
        if frontier >= min(limit, self.first_stop + 1):
            cut = Status.CONTEXT if self.context_bound else Status.LENGTH
            self.status = Status.STOP if self.first_stop < frontier else cut
        return written

    def finish(self, reason: Status) -> None:
        """End it between steps (`CANCELLED`: its client left; `STOP`: a stop string ended its text): it
        takes part in no further forward and commits nothing more."""
        if not self.finished:
            self.status = reason

    @property
    def finish_reason(self) -> str:
        """Why it ended (see `Generation`); "interrupted" while it has not."""
        return self.status.value if self.finished else "interrupted"

    def result(self, decode: Callable[[list[int]], str]) -> Generation:
        """Its output so far, as text too (`decode`), with its figures and why it ended."""
        ids = self.output
        seconds = time.perf_counter() - self.started
        stats = Stats(self.forwards, len(ids), seconds, self.prefill_seconds, dict(self.steps), self.queries)
        return Generation(ids, decode(ids), stats, self.finish_reason)


def make_rows(
    model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int | Sequence[int], sampler: Sampler
) -> list[Row]:
    """The rows of `prompts` with their budgets (one, or one per prompt), checked against the model's
    context, stopping at its stop tokens; a row without a sampler of its own samples with `sampler`."""
    if not prompts:
        raise FastForwardError("no prompts given")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts) or min(budgets) <= 0:
        raise FastForwardError(f"max_new_tokens must be > 0 (one, or one per prompt), got {max_new_tokens}")
    given = [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]
    context, stops = model.max_context, frozenset(model.stop_token_ids)
    longest = max(len(p.prefix) + p.gap + len(p.suffix) for p in given)
    if context is not None and longest >= context:
        raise FastForwardError(
            f"a prompt has {longest} tokens but the model's context is {context}; shorten the prompt"
        )
    rows = []
    for p, budget in zip(given, budgets, strict=True):
        limit = p.gap if p.suffix else min(budget, (context or 10**9) - len(p.prefix))
        rows.append(
            Row(
                list(p.prefix),
                list(p.suffix),
                limit,
                p.sampler or sampler,
                frozenset() if p.ignore_eos else stops,
                seed=p.seed,
                context_bound=not p.suffix and limit < budget,
            )
        )
    return rows
