"""Plain next-token decoding with a KV cache: the baseline every speedup is measured against."""

from __future__ import annotations

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import SAMPLING, register
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler


class ARDecoder(Decoder):
    """One token per forward at the next position, causal; greedy or sampled."""

    name = "ar"

    def __init__(self, sampler: Sampler | None = None):
        self.sampler = sampler or Sampler()

    def decode(self, session: Session) -> None:
        token = session.sample(session.next_logits, session.next_pos)[:, None]
        session.append(token)
        while not session.finished:
            positions = session.span(-1, 1)  # the last committed token's
            logits = session.forward(token, positions, read=range(1))[:, 0]
            token = session.sample(logits, positions[:, 0] + 1)[:, None]
            session.append(token)
            session.advance(keep=1)


@register("ar", knobs=SAMPLING, summary="next-token decoding, one token per forward (the baseline)", lossless=True)
def _build(sampler: Sampler) -> ARDecoder:
    return ARDecoder(sampler)
