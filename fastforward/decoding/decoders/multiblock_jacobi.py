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
from fastforward.decoding.decoders.registry import BLOCK_SIZE, SAMPLING, Knob, register
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import verify


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


class MultiBlockJacobiDecoder(Decoder):
    """Lossless multi-block Jacobi decoding with rejection recycling.

    block_size n, max_blocks K, spawn_ratio r, verify: n-gram candidates checked per forward,
    ngram: candidate length (default n).
    """

    name = "jacobi-mr"

    def __init__(
        self,
        block_size: int = 16,
        max_blocks: int = 2,
        spawn_ratio: float = 0.85,
        verify: int = 2,
        ngram: int = 0,
        sampler: Sampler | None = None,
    ):
        self.n, self.max_blocks, self.verify = block_size, max_blocks, verify
        self.spawn_at = math.ceil(spawn_ratio * block_size)
        self.ngram = ngram or block_size
        self.sampler = sampler or Sampler()

    def new_pool(self) -> NgramPool:
        """The candidate pool for one prompt (empty; a subclass may seed it, e.g. from the prompt)."""
        return NgramPool(per_key=max(self.verify, 1))

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        first = session.commit_next_tokens(rows)
        for index in rows:
            session.rows[index].state = MultiBlockState(self.new_pool(), first[index], [first[index]] * self.n, self.n)

    def step(self, session: Session) -> None:
        n = self.n
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
            state.pool.add_rejected(state.drafts, verdict.chain_accepted, self.ngram)
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


@register(
    "jacobi-mr",
    knobs=(
        BLOCK_SIZE,
        Knob("max_blocks", int, 2, "jacobi-mr: blocks refined at once (K)", check=lambda v: v >= 1, rule=">= 1"),
        Knob(
            "spawn_ratio",
            float,
            0.85,
            "jacobi-mr: spawn a block at ⌈r·n⌉ confirmed",
            check=lambda v: 0 < v <= 1,
            rule="in (0, 1]",
        ),
        Knob(
            "verify", int, 2, "jacobi-mr: recycled n-gram candidates per forward", check=lambda v: v >= 0, rule=">= 0"
        ),
        Knob("ngram", int, 0, "jacobi-mr: candidate length (0: the block size)", check=lambda v: v >= 0, rule=">= 0"),
        *SAMPLING,
    ),
    summary="multi-block Jacobi with rejection recycling (Jacobi Forcing, Algorithm 1)",
    lossless=True,
)
def _build(
    block_size: int, max_blocks: int, spawn_ratio: float, verify: int, ngram: int, sampler: Sampler
) -> MultiBlockJacobiDecoder:
    return MultiBlockJacobiDecoder(block_size, max_blocks, spawn_ratio, verify, ngram, sampler)
