"""Plain next-token decoding with a KV cache: the baseline every speedup is measured against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import register, sampling
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import append, first_tokens, span


@dataclass
class ARState:
    last: int  # the token the next forward feeds: the row's last sampled one


@register("ar", summary="next-token decoding, one token per forward (the baseline)", lossless=True)
@dataclass(eq=False)
class ARDecoder(Decoder):
    """One token per forward at the next position, causal; greedy or sampled."""

    sampler: Sampler = sampling()

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        first = first_tokens(session, rows)
        for index in rows:
            session.rows[index].state = ARState(first[index])

    def step(self, session: Session) -> None:
        token = torch.tensor([row.state.last for row in session.rows], device=session.device)[:, None]
        positions = span(session, -1, 1)  # the last committed token's
        logits = session.forward(token, positions, read=range(1))[:, 0]
        sampled = session.sampler.sample(logits, positions[:, 0] + 1).tolist()
        for row, last in zip(session.rows, sampled, strict=True):
            row.state.last = last
        append(session, [[t] for t in sampled])
        session.advance(keep=1)
