"""Jacobi decoding with several blocks and rejection recycling (Jacobi Forcing, Algorithm 1).

One forward holds `[last committed token ; draft chain ; candidates]`:

* the draft chain is the real-active block (its remaining drafts) followed by up to K − 1
  pseudo-active blocks of n drafts that keep refining ahead of it (causal, one chain), and never
  shorter than plain Jacobi's n drafts;
* candidates are n-grams recycled from earlier rejected drafts that start where the committed
  text ends; each sees only the cache, the last token and itself.

Whichever of the chain or the candidates has the longest confirmed prefix is committed, with the
prediction after it, so the output is exactly AR decoding (greedy, or sampled with each position's
own draw: `fastforward.decoding.sampling`). A new pseudo-active block is spawned once a block has
⌈r·n⌉ confirmed (or stationary) tokens. Rows of a batch share each forward, their layouts padded
to the longest (`steps.verify`).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, register, sampling
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import first_tokens, verify
from fastforward.options import AT_LEAST_ONE, NON_NEGATIVE, SHARE, option


class NgramPool:
    """Recent n-grams seen in rejected drafts, keyed by their first token (most recent first)."""

    def __init__(self, per_key: int):
        self.grams: dict[int, deque[tuple[int, ...]]] = defaultdict(lambda: deque(maxlen=per_key))

    def add_rejected(self, drafts: list[int], accepted: int, length: int) -> None:
        for i in range(accepted, len(drafts) - 1):
            gram = tuple(drafts[i + 1 : i + 1 + length])
            bucket = self.grams[drafts[i]]
            if gram not in bucket:
                bucket.appendleft(gram)

    def candidates(self, token: int, limit: int) -> list[list[int]]:
        return [list(g) for g in list(self.grams.get(token, ()))[:limit]]


@dataclass
class MultiBlockState:
    pool: NgramPool  # n-grams of the row's rejected drafts
    last: int  # its last committed token
    drafts: list[int]  # the draft chain after it
    left: int  # drafts left in the real-active block
    pseudo: int = 0  # pseudo-active blocks refined ahead of it


@register(
    "jacobi-mr", summary="multi-block Jacobi with rejection recycling (Jacobi Forcing, Algorithm 1)", lossless=True
)
@dataclass(eq=False)
class MultiBlockJacobiDecoder(Decoder):
    """Lossless multi-block Jacobi decoding with rejection recycling.

    block_size n, max_blocks K, spawn_ratio r, verify: n-gram candidates checked per forward,
    ngram: candidate length (0: n).
    """

    block_size: int = BLOCK_SIZE.field()
    max_blocks: int = option(2, "jacobi-mr: blocks refined at once (K)", AT_LEAST_ONE)
    spawn_ratio: float = option(0.85, "jacobi-mr: spawn a block at ⌈r·n⌉ confirmed", SHARE)
    verify: int = option(2, "jacobi-mr: recycled n-gram candidates per forward", NON_NEGATIVE)
    ngram: int = option(0, "jacobi-mr: candidate length (0: the block size)", NON_NEGATIVE)
    sampler: Sampler = sampling()

    @property
    def spawn_at(self) -> int:
        """Confirmed (or stationary) tokens of a block that spawn the next pseudo-active block: ⌈r·n⌉."""
        return math.ceil(self.spawn_ratio * self.block_size)

    @property
    def gram(self) -> int:
        """The length of a recycled candidate."""
        return self.ngram or self.block_size

    def new_pool(self) -> NgramPool:
        """The candidate pool for one prompt (empty; a subclass may seed it, e.g. from the prompt)."""
        return NgramPool(per_key=max(self.verify, 1))

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        first = first_tokens(session, rows)
        n = self.block_size
        for index in rows:
            session.rows[index].state = MultiBlockState(self.new_pool(), first[index], [first[index]] * n, n)

    def step(self, session: Session) -> None:
        n = self.block_size
        states: list[MultiBlockState] = [row.state for row in session.rows]
        running = [not row.finished for row in session.rows]
        # a finished row runs its last token alone (nothing of it is read)
        drafts = [s.drafts if runs else [] for s, runs in zip(states, running, strict=True)]
        cands = [
            s.pool.candidates(s.last, self.verify) if runs else [] for s, runs in zip(states, running, strict=True)
        ]
        verdicts = verify(session, [s.last for s in states], drafts, cands, tail=n)
        for state, runs, verdict in zip(states, running, verdicts, strict=True):
            if not runs:
                continue
            state.pool.add_rejected(state.drafts, verdict.chain_accepted, self.gram)
            state.last = verdict.committed[-1]
            stationary = verdict.stationary if state.pseudo else verdict.accepted
            state.left -= verdict.accepted + 1
            while state.left <= 0:  # the real-active block is done: promote the next block (or start one)
                state.left += n
                state.pseudo = max(state.pseudo - 1, 0)
            if stationary >= self.spawn_at and state.pseudo + 1 < self.max_blocks:
                state.pseudo += 1
            want = max(state.left + n * state.pseudo, n)  # never fewer drafts than plain Jacobi
            state.drafts = (verdict.ahead + [state.last] * want)[:want]
