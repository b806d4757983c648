"""Plain next-token decoding with a KV cache: the baseline every speedup is measured against."""

from __future__ import annotations

import torch

from fastforward.decoders.base import Decoder, Session
from fastforward.sampling import Sampler


class ARDecoder(Decoder):
    """One token per forward at the next position, causal; greedy or sampled."""

    name = "ar"

    def __init__(self, sampler: Sampler | None = None):
        self.sampler = sampler or Sampler()

    def decode(self, session: Session) -> None:
        ones = torch.ones(session.batch, 1, dtype=torch.long, device=session.device)
        logits = session.next_logits
        while True:
            token = self.sampler(logits)[:, None]
            session.finish_rows(token, ones[:, 0])
            if bool(session.done.all()):
                return
            logits = session.run(token, session.next_pos[:, None], None, read=[0], keep=1)[:, 0]
            session.next_pos += 1
            session.count_forward()
            session.record_step([1] * session.batch)
