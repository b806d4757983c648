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

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, SAMPLING, Knob, register
from fastforward.decoding.policies import greedy_prefix
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError

DRAFT_INITS = ("repeat", "random")


class JacobiDecoder(Decoder):
    """Jacobi decoding with blocks of `block_size` drafts, greedy or sampled.

    init: how fresh draft slots are filled — "repeat" copies the last committed token, "random"
    draws random vocabulary ids (seeded by the sampler's seed). Acceptance is decided on the host
    after one read-back of the forward's predictions per step (cheaper than a dozen small tensor ops).
    """

    name = "jacobi"

    def __init__(self, block_size: int = 16, init: str = "repeat", sampler: Sampler | None = None):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        if init not in DRAFT_INITS:
            raise FastForwardError(f"unknown draft init {init!r}; choose one of {', '.join(DRAFT_INITS)}")
        self.block_size = block_size
        self.init = init
        self.sampler = sampler or Sampler()

    def _filler(self, session: Session, row: int, last: int) -> list[int]:
        """Draft tokens for the n slots of a fresh block of one row (after its last token `last`)."""
        n = self.block_size
        if self.init == "repeat":
            return [last] * n
        vocab = session.model.vocab_size
        generator = torch.Generator().manual_seed(session.sampler.seed + 1000003 * row + session.frontiers[row])
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    continuous = True

    def _drafts(self, session: Session) -> int:
        """Drafts per row this step: the block size, or fewer when `session.step_tokens` bounds the
        tokens of a forward over its running rows (the output is the same; only the forwards change)."""
        row_tokens = session.row_tokens()
        return self.block_size if row_tokens is None else max(1, min(self.block_size, row_tokens - 1))

    def begin(self, session: Session, rows: range) -> None:
        first = session.commit_next_tokens(rows)
        last, drafts = session.per_row("last"), session.per_row("drafts")
        for row in rows:
            last[row] = first[row]
            drafts[row] = self._filler(session, row, first[row])

    def step(self, session: Session) -> None:
        n = self._drafts(session)
        last, drafts = session.per_row("last"), session.per_row("drafts")
        for row, draft in enumerate(drafts):
            if len(draft) != n:  # fewer drafts while many rows share the forward, more again later
                drafts[row] = (draft + self._filler(session, row, last[row]))[:n]
        tokens = torch.tensor([[t, *d] for t, d in zip(last, drafts, strict=True)], device=session.device)
        # the last committed token, one position before the frontier, then the n drafts
        positions = session.span(-1, n + 1)
        logits = session.forward(tokens, positions, read=range(n + 1))
        guesses = session.sample(logits, positions + 1).tolist()  # guesses[r][i]: the token after tokens[r][i]
        accepted = [greedy_prefix(d, g) for d, g in zip(drafts, guesses, strict=True)]
        session.append([g[: a + 1] for g, a in zip(guesses, accepted, strict=True)])  # confirmed + next
        session.advance(keep=[a + 1 for a in accepted])  # the last token and its confirmed drafts
        for row, (guess, a) in enumerate(zip(guesses, accepted, strict=True)):
            last[row] = guess[a]
            # The predictions past the first correction are the next drafts; fresh slots get filler.
            carried = guess[a + 1 :]
            drafts[row] = carried + self._filler(session, row, last[row])[len(carried) :]


DRAFT_INIT = Knob("draft_init", str, "repeat", "jacobi: how fresh draft slots are filled", DRAFT_INITS)


@register(
    "jacobi",
    knobs=(BLOCK_SIZE, DRAFT_INIT, *SAMPLING),
    summary="Jacobi decoding: n drafts refined in parallel, confirmed prefix accepted",
    lossless=True,
)
def _build(block_size: int, draft_init: str, sampler: Sampler) -> JacobiDecoder:
    return JacobiDecoder(block_size, draft_init, sampler)
