"""Jacobi decoding: n draft tokens refined in parallel; output identical to greedy AR decoding.

One causal forward of `[last committed token ; n drafts]` gives greedy predictions g_0..g_n. The
drafts are accepted while d_{i+1} = g_i; the accepted drafts plus the first prediction after them
are committed, so every forward yields at least one token, all of them exactly what greedy AR
decoding would produce. Only the accepted entries stay in the KV cache (a crop, no copy); the
remaining predictions become the next drafts.
"""

from __future__ import annotations

import torch

from fastforward.decoders.base import Decoder
from fastforward.decoders.registry import BLOCK_SIZE, SEED, Knob, register
from fastforward.errors import FastForwardError
from fastforward.policies import greedy_prefix
from fastforward.runtime import Session
from fastforward.sampling import greedy

DRAFT_INITS = ("repeat", "random")


class JacobiDecoder(Decoder):
    """Greedy Jacobi decoding with blocks of `block_size` drafts.

    init: how fresh draft slots are filled — "repeat" copies the last committed token, "random"
    draws seeded random vocabulary ids.
    """

    name = "jacobi"

    def __init__(self, block_size: int = 16, init: str = "repeat", seed: int = 0):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        if init not in DRAFT_INITS:
            raise FastForwardError(f"unknown draft init {init!r}; choose one of {', '.join(DRAFT_INITS)}")
        self.block_size = block_size
        self.init = init
        self.seed = seed

    def _filler(self, session: Session, last: torch.Tensor) -> torch.Tensor:
        """Draft tokens [B, n] for slots that have no prediction yet."""
        n = self.block_size
        if self.init == "repeat":
            return last[:, None].expand(-1, n)
        generator = torch.Generator(device=session.device).manual_seed(self.seed + session.produced)
        vocab = session.model.hf.get_output_embeddings().weight.shape[0]
        return torch.randint(0, vocab, (session.batch, n), generator=generator, device=session.device)

    def decode(self, session: Session) -> None:
        n = self.block_size
        last = greedy(session.next_logits)
        session.append(last[:, None])
        drafts = self._filler(session, last)
        steps = torch.arange(n + 1, device=session.device)
        behind = steps - 1  # the last committed token sits one position before the frontier
        ahead = steps[1:]
        while not session.finished:
            tokens = torch.cat([last[:, None], drafts], dim=1)
            logits = session.forward(tokens, session.next_pos[:, None] + behind, read=steps)
            guess = greedy(logits)  # guess[:, i] is the greedy token after tokens[:, i]
            accepted = greedy_prefix(drafts, guess[:, :n])
            session.append(guess, accepted + 1)  # the confirmed drafts and the prediction after them
            session.advance(keep=accepted + 1)  # the last token and its confirmed drafts
            last = guess.gather(1, accepted[:, None])[:, 0]
            # The predictions past the first correction are the next drafts; fresh slots get filler.
            source = accepted[:, None] + ahead
            carried = guess.gather(1, source.clamp_max(n))
            drafts = torch.where(source <= n, carried, self._filler(session, last))


DRAFT_INIT = Knob("draft_init", str, "repeat", "jacobi: how fresh draft slots are filled", DRAFT_INITS)


@register(
    "jacobi",
    knobs=(BLOCK_SIZE, DRAFT_INIT, SEED),
    summary="Jacobi decoding: n drafts refined in parallel, greedy-confirmed prefix accepted",
    lossless=True,
)
def _build(block_size: int, draft_init: str, seed: int) -> JacobiDecoder:
    return JacobiDecoder(block_size, draft_init, seed)
