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
⌈r·n⌉ confirmed (or stationary) tokens. Rows of a batch are decoded one after another: their
candidate layouts differ.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, SAMPLING, Knob, register
from fastforward.decoding.policies import greedy_prefix
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.model import visibility


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


class MultiBlockJacobiDecoder(Decoder):
    """Lossless multi-block Jacobi decoding with rejection recycling.

    block_size n, max_blocks K, spawn_ratio r, verify: n-gram candidates checked per forward,
    ngram: candidate length (default n).
    """

    name = "jacobi-mr"
    rows_apart = True

    def __init__(
        self,
        block_size: int = 16,
        max_blocks: int = 2,
        spawn_ratio: float = 0.85,
        verify: int = 2,
        ngram: int = 0,
        sampler: Sampler | None = None,
    ):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        if max_blocks < 1 or verify < 0 or not 0 < spawn_ratio <= 1:
            raise FastForwardError("need max_blocks >= 1, verify >= 0 and 0 < spawn_ratio <= 1")
        self.n, self.max_blocks, self.verify = block_size, max_blocks, verify
        self.spawn_at = math.ceil(spawn_ratio * block_size)
        self.ngram = ngram or block_size
        self.sampler = sampler or Sampler()

    def new_pool(self) -> NgramPool:
        """The candidate pool for one prompt (empty; a subclass may seed it, e.g. from the prompt)."""
        return NgramPool(per_key=max(self.verify, 1))

    def decode(self, session: Session) -> None:
        n = self.n
        pool = self.new_pool()
        last = int(session.sample(session.next_logits, session.next_pos)[0])
        session.append([[last]])
        drafts, ra_left, pseudo = [last] * n, n, 0
        while not session.finished:
            cands = pool.candidates(last, self.verify)
            verdict = verify(session, last, drafts, cands, tail=n)
            pool.add_rejected(drafts, verdict.chain_accepted, self.ngram)
            last = verdict.committed[-1]
            stationary = verdict.stationary if pseudo else verdict.accepted
            ra_left -= verdict.accepted + 1
            while ra_left <= 0:  # the real-active block is done: promote the next block (or start one)
                ra_left += n
                pseudo = max(pseudo - 1, 0)
            if stationary >= self.spawn_at and pseudo + 1 < self.max_blocks:
                pseudo += 1
            want = max(ra_left + n * pseudo, n)  # never fewer drafts than plain Jacobi
            drafts = (verdict.ahead + [last] * want)[:want]


def verify(session: Session, last: int, drafts: list[int], cands: list[list[int]], tail: int) -> Verdict:
    """One forward of `[last ; drafts ; candidates]` (see `visibility.jacobi_candidates`); commit
    the contender (the chain or a candidate) with the longest confirmed prefix, and the prediction
    after it; keep exactly those entries in the cache. Decided on the host after one read-back of
    the forward's predictions (`session.sample`'s: a position's draw is the same in every contender).
    `tail`: how many of the last drafts count as the last block when measuring how stationary it
    is (0: not measured)."""
    chain = 1 + len(drafts)
    lengths = tuple(len(c) for c in cands)
    total = chain + sum(lengths)
    # A chain alone, or one candidate after the last token alone, is plain causal: the model's own
    # fast path, no dense mask to build.
    causal = not cands or (chain == 1 and len(cands) == 1)
    rule = None if causal else visibility.jacobi_candidates(chain, lengths, session.device)
    ids = [last, *drafts, *(t for c in cands for t in c)]
    offsets = [*range(chain), *(j for length in lengths for j in range(1, length + 1))]
    start = session.origins[0] + session.frontiers[0] - 1  # where `last` sits
    layout = torch.tensor([ids, [start + o for o in offsets]], device=session.device)  # tokens, positions
    logits = session.forward(layout[:1], layout[1:], rule, read=range(total))
    guesses = session.sample(logits, layout[1:] + 1)[0].tolist()  # each slot's prediction of the next token
    # Each contender's token slots, and the slot whose prediction should equal each token.
    token_slots, pred_slots = [list(range(1, chain))], [list(range(chain - 1))]
    begin = chain
    for length in lengths:
        token_slots.append(list(range(begin, begin + length)))
        pred_slots.append([0, *range(begin, begin + length - 1)])
        begin += length
    counts = [
        greedy_prefix([ids[s] for s in slots], [guesses[s] for s in preds])
        for slots, preds in zip(token_slots, pred_slots, strict=True)
    ]
    best = max(range(len(counts)), key=counts.__getitem__)  # the chain wins ties, then the earliest
    accepted = counts[best]
    kept = [0, *token_slots[best][:accepted]]
    committed = [guesses[s] for s in kept]  # the prediction after each kept token
    session.append([committed])
    session.advance(keep=[kept])
    stationary = greedy_prefix(drafts[-tail:], guesses[chain - 1 - tail : chain - 1]) if tail else 0
    # Predictions past the accepted ones seed the next drafts: the winner's, then the chain's.
    ahead = guesses[:chain]
    if best:
        winner = [guesses[s] for s in pred_slots[best]] + [guesses[token_slots[best][-1]]]
        ahead[: len(winner)] = winner
        ahead += winner[len(ahead) :]
    return Verdict(accepted, best, counts[0], stationary, committed, ahead[accepted + 1 :])


@dataclass
class Verdict:
    """What one multi-block Jacobi forward decided."""

    accepted: int  # tokens of the winning contender confirmed
    winner: int  # 0: the draft chain; i > 0: candidate i - 1
    chain_accepted: int  # of the draft chain's, confirmed
    stationary: int  # of the last block of the chain, confirmed against its own predictions
    committed: list[int]  # the confirmed tokens and the prediction after them
    ahead: list[int]  # predictions for the positions after those


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
