"""Jacobi decoding: n draft tokens refined in parallel; output identical to AR decoding.

One causal forward of `[last committed token ; n drafts]` gives predictions g_0..g_n (greedy, or
sampled with each position's own draw, `fastforward.decoding.sampling`). The drafts are accepted
while d_{i+1} = g_i; the accepted drafts plus the first prediction after them are committed, so
every forward yields at least one token, all of them exactly what AR decoding with the same sampler
would produce. Only the accepted entries stay in the KV cache (a crop, no copy); the remaining
predictions become the next drafts (sampled ones with the draws that will verify them, so a draft
whose context stands is accepted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, register, sampling
from fastforward.decoding.runtime import Row, Session
from fastforward.decoding.sampling import Sampler, random_tokens
from fastforward.decoding.steps import chain_step, first_tokens, row_tokens
from fastforward.options import option

DRAFT_INITS = ("repeat", "random")


@dataclass
class JacobiState:
    last: int  # the row's last committed token, which the next forward feeds first
    drafts: list[int]  # the tokens after it, to be confirmed


@register("jacobi", summary="Jacobi decoding: n drafts refined in parallel, confirmed prefix accepted", lossless=True)
@dataclass(eq=False)
class JacobiDecoder(Decoder):
    """Jacobi decoding with blocks of `block_size` drafts, greedy or sampled.

    init: how fresh draft slots are filled — "repeat" copies the last committed token, "random"
    draws random vocabulary ids (keyed by the row's seed and each slot's position). Acceptance is
    decided on the host after one read-back of the forward's predictions per step (cheaper than a
    dozen small tensor ops).
    """

    block_size: int = BLOCK_SIZE.field()
    init: str = option("repeat", "jacobi: how fresh draft slots are filled", choices=DRAFT_INITS, name="draft_init")
    sampler: Sampler = sampling()

    def _fill(self, session: Session, row: Row, drafts: list[int], last: int, n: int) -> list[int]:
        """A row's `drafts` cut or completed to n slots (slot i at its canvas position frontier + i, after
        its last token `last`). A fresh slot repeats `last`, or with init "random" takes the row's own
        random id for its position (`sampling.random_tokens`): a request's drafts, and so its forwards,
        do not depend on its slot in a batch."""
        fresh = range(len(drafts), n)
        if self.init == "repeat":
            return drafts[:n] + [last] * len(fresh)
        first = row.origin + row.frontier
        return drafts[:n] + random_tokens(row.key, [first + i for i in fresh], session.model.vocab_size)

    def _drafts(self, session: Session) -> int:
        """Drafts per row this step: the block size, or fewer when `session.step_tokens` bounds the
        tokens of a forward over its running rows (the output is the same; only the forwards change)."""
        bound = row_tokens(session)
        return self.block_size if bound is None else max(1, min(self.block_size, bound - 1))

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        first = first_tokens(session, rows)
        for index in rows:
            row = session.rows[index]
            row.state = JacobiState(first[index], self._fill(session, row, [], first[index], self.block_size))

    def step(self, session: Session) -> None:
        n = self._drafts(session)
        states: list[JacobiState] = [row.state for row in session.rows]
        for row, state in zip(session.rows, states, strict=True):
            if len(state.drafts) != n:  # fewer drafts while many rows share the forward, more again later
                state.drafts = self._fill(session, row, state.drafts, state.last, n)
        guesses, accepted = chain_step(session, [s.last for s in states], [s.drafts for s in states])
        for row, state, guess, a in zip(session.rows, states, guesses, accepted, strict=True):
            state.last = guess[a]
            # The predictions past the first correction are the next drafts; fresh slots get filler.
            state.drafts = self._fill(session, row, guess[a + 1 :], state.last, self.block_size)
