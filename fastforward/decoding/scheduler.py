"""Which waiting jobs join the running batches now, and which batch steps next: pure functions of the
queue, the running jobs and the limits, so the policy is tested without threads or a model.

Admission is bounded by `max_batch_size` rows and `max_batch_tokens` tokens in flight (prompt plus
budget of every running row). Between two steps at most `max_prefill_tokens` prompt tokens join (one
job at least), so that a burst of long prompts prefills over several turns: the running rows keep
streaming, and the first jobs of the burst get their first tokens before the last ones are prefilled.
Jobs join in arrival order, and the first that does not fit stops admission for this turn: a long
prompt is not overtaken forever by short ones behind it. Admitted jobs are grouped by decoder setting
(a value: `Decoder.batch_key`), as jobs of one setting share a batch; batches of different settings
take turns, one step each.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Waiting(Protocol):
    """What admission reads of a request (`engine_core.Request`)."""

    max_tokens: int

    @property
    def prompt_tokens(self) -> int: ...  # the tokens its prefill caches

    @property
    def setting(self) -> Hashable: ...  # jobs of equal settings share a batch

    cancelled: bool


J = TypeVar("J", bound=Waiting)


@dataclass(frozen=True)
class Limits:
    """The bounds admission keeps (`EngineCore`'s, set by `serve`'s options of the same names)."""

    max_batch_size: int  # rows in flight, every batch together
    max_batch_tokens: int | None  # prompt plus budget of every row in flight; None: no bound
    max_prefill_tokens: int  # prompt tokens joining between two steps (one job at least)


def admit(waiting: Iterable[J], running: Sequence[J], limits: Limits) -> dict[Hashable, list[J]]:
    """The waiting jobs that join now, by setting (settings in the order their first job waited, each
    one's jobs in arrival order). `running`: the jobs still decoding. A job alone always fits the token
    bounds, so an oversized one runs by itself rather than never; a cancelled job is passed over (its
    client left, and the engine core takes it off the queue)."""
    rows = len(running)
    tokens = sum(job.prompt_tokens + job.max_tokens for job in running)
    prefill = 0  # prompt tokens admitted in this turn
    admitted: dict[Hashable, list[J]] = {}
    for job in waiting:
        if job.cancelled:
            continue
        size = job.prompt_tokens + job.max_tokens
        full = rows >= limits.max_batch_size or (
            limits.max_batch_tokens is not None and tokens + size > limits.max_batch_tokens and rows > 0
        )
        # Past the prefill budget it waits for the next turn.
        enough = prefill > 0 and prefill + job.prompt_tokens > limits.max_prefill_tokens
        if full or enough:
            break
        admitted.setdefault(job.setting, []).append(job)
        rows, tokens, prefill = rows + 1, tokens + size, prefill + job.prompt_tokens
    return admitted


def next_batch(settings: Sequence[Hashable], turn: int) -> Hashable:
    """The setting whose batch steps at the `turn`-th step: round robin, so a long request of one setting
    holds up no other."""
    return settings[turn % len(settings)]
