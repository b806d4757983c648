"""Set Block Decoding (SBD paper, Algorithms 2 and 3) with an exact KV cache.

Each block starts as k mask tokens. A forward reads the whole block (it sees the cache and itself
bidirectionally); a reveal policy picks which masked positions to fill. When the block is full it
is not written to the cache at once: it rides along, causally, in front of the next block's first
forward (the paper's time(2k) term) and only those entries are kept, so the cache always holds
exactly what a causal prefill of the same tokens would.
"""

from __future__ import annotations

import torch

from fastforward import visibility
from fastforward.decoders.base import Decoder, Session
from fastforward.errors import FastForwardError
from fastforward.policies import EntropyBounded
from fastforward.sampling import Sampler


def after_stop(block: torch.Tensor, masked: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """Positions after each row's first revealed stop token: the output is cut there, so no
    forward is worth spending on them."""
    is_stop = (torch.isin(block, stop_ids) & ~masked).long()
    return (is_stop.cumsum(-1) - is_stop) > 0


class SBDDecoder(Decoder):
    """Blocks of `block_size` masks, revealed by `policy` (default: entropy-bounded, γ = 0.35).

    first_token_from_ntp: take each block's first token from the next-token prediction of the
    last committed token, which the commit forward (or the prefill) computes anyway.
    """

    name = "sbd"

    def __init__(
        self, block_size: int = 16, policy=None, sampler: Sampler | None = None, first_token_from_ntp: bool = False
    ):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.policy = policy or EntropyBounded(0.35)
        self.sampler = sampler or Sampler()
        self.first_token_from_ntp = first_token_from_ntp

    def decode(self, session: Session) -> None:
        mask_id = session.model.require_mask_token(self.name)
        pending: torch.Tensor | None = None  # the finished block, not yet in the cache
        while not bool(session.done.all()):
            size = min(self.block_size, session.max_new_tokens - session.produced)
            block = torch.full((session.batch, size), mask_id, dtype=torch.long, device=session.device)
            masked = torch.ones_like(block, dtype=torch.bool)
            if self.first_token_from_ntp and pending is None:
                block[:, 0] = self.sampler(session.next_logits)
                masked[:, 0] = False
            running = ~session.done
            first = True
            while bool((masked & ~session.done[:, None]).any()):
                commit = pending.shape[1] if (first and pending is not None) else 0
                logits = self._forward(session, block, pending if commit else None)
                session.count_forward()
                revealed = torch.zeros(session.batch, dtype=torch.long, device=session.device)
                if commit and self.first_token_from_ntp:
                    block[:, 0] = self.sampler(logits[:, 0])
                    masked[:, 0] = False
                    revealed += 1
                    logits = logits[:, 1:]
                reveal = self.policy(logits, masked)
                block = torch.where(reveal, self.sampler(logits), block)
                masked &= ~reveal
                revealed += reveal.sum(-1)
                session.record_step(revealed.tolist())
                masked &= ~after_stop(block, masked, session.stop_ids)
                # a revealed stop token with nothing masked left (before it): no more forwards for the row
                stopped = (torch.isin(block, session.stop_ids) & ~masked).any(-1)
                session.done |= stopped & ~masked.any(-1)
                first = False
                if commit:
                    pending = None
            session.finish_rows(block, torch.full((session.batch,), size, device=session.device), running)
            session.next_pos += size
            pending = block

    def _forward(self, session: Session, block: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        """One forward of `[pending (kept, causal) ; block (read)]`; logits for the block's positions.

        With the first-token option the last pending token is read too (its next-token prediction).
        """
        size = block.shape[1]
        commit = 0 if pending is None else pending.shape[1]
        tokens = block if pending is None else torch.cat([pending, block], dim=1)
        offsets = torch.arange(-commit, size, device=session.device)
        positions = session.next_pos[:, None] + offsets[None]
        read_from = commit - 1 if (commit and self.first_token_from_ntp) else commit
        rule = visibility.sbd_decode(commit, size, session.device)
        return session.run(tokens, positions, rule, read=list(range(read_from, commit + size)), keep=commit)
