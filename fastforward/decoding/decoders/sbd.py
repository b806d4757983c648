"""Set Block Decoding (SBD paper, Algorithms 2 and 3) with an exact KV cache.

Each block starts as k mask tokens. A forward reads the whole block (it sees the cache and itself
bidirectionally); a reveal policy picks which masked positions to fill. When the block is full it
is not written to the cache at once: it rides along, causally, in front of the next block's first
forward (the paper's time(2k) term) and only those entries are kept, so the cache always holds
exactly what a causal prefill of the same tokens would. With a sampler at temperature > 0 each
revealed position's token is sampled from its predicted distribution (with the position's own draw,
`fastforward.decoding.sampling`); the policy still decides which positions on the model's
distributions, so temperature 0 is greedy SBD, unchanged.
"""

from __future__ import annotations

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, FIRST_TOKEN_FROM_NTP, GAMMA, POLICY, SAMPLING, register
from fastforward.decoding.policies import EntropyBounded, make_policy
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.model import visibility


def after_stop(block: torch.Tensor, masked: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """Positions after each row's first revealed stop token: the output is cut there, so no
    forward is worth spending on them."""
    is_stop = (block[..., None] == stop_ids).any(-1) & ~masked
    return is_stop.cumsum(-1) > is_stop


def still_masked(session: Session, masked: torch.Tensor) -> bool:
    """Whether a running row of the batch still has masked positions in its block."""
    if not any(session.finished_rows):
        return bool(masked.any())
    return bool((masked & ~session.done[:, None]).any())


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
        while not session.finished:
            base = session.frontier[:, None]  # the block's first canvas position (alike for running rows)
            size = min(self.block_size, session.max_new_tokens - session.produced)
            end = session.produced + size
            slots = base + torch.arange(size, device=session.device)
            positions = session.origin[:, None] + slots
            block = torch.full((session.batch, size), mask_id, dtype=torch.long, device=session.device)
            masked = torch.ones_like(block, dtype=torch.bool)
            if self.first_token_from_ntp and pending is None:
                block[:, 0] = session.sample(session.next_logits, positions[:, 0])
                masked[:, 0] = False
                session.commit(block[:, :1], slots[:, :1])
            while still_masked(session, masked):
                logits = self._forward(session, block, pending, positions)
                first = None
                if pending is not None and self.first_token_from_ntp:
                    # the NTP prediction after the pending block
                    block[:, 0] = session.sample(logits[:, 0], positions[:, 0])
                    first = torch.zeros_like(masked)
                    first[:, 0] = masked[:, 0]
                    masked &= ~first
                    logits = logits[:, 1:]
                reveal = self.policy(logits, masked)
                block = torch.where(reveal, session.sample(logits, positions), block)
                if first is not None:
                    reveal |= first
                session.commit(block, slots, reveal)
                masked &= ~reveal
                if any(stop < end for stop in session.first_stops):  # a stop token was revealed here
                    masked &= ~after_stop(block, masked, session.stop_ids)
                session.advance(keep=0 if pending is None else pending.shape[1])
                pending = None
            pending = block

    def _forward(
        self, session: Session, block: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor
    ) -> torch.Tensor:
        """One forward of `[pending (kept, causal) ; block (read)]`; logits for the block's positions.

        With the first-token option the last pending token is read too (its next-token prediction).
        """
        size = block.shape[1]
        if pending is None:
            rule = visibility.sbd_decode(0, size, session.device)
            return session.forward(block, positions, rule, read=range(size))
        commit = pending.shape[1]
        tokens = torch.cat([pending, block], dim=1)
        positions = positions[:, :1] + torch.arange(-commit, size, device=session.device)
        read_from = commit - 1 if self.first_token_from_ntp else commit
        rule = visibility.sbd_decode(commit, size, session.device)
        return session.forward(tokens, positions, rule, read=range(read_from, commit + size))


@register(
    "sbd",
    knobs=(BLOCK_SIZE, POLICY, GAMMA, FIRST_TOKEN_FROM_NTP, *SAMPLING),
    summary="Set Block Decoding: blocks of masks revealed by a policy, exact KV cache",
    needs_mask=True,
)
def _build(block_size: int, policy: str, gamma: float, first_token_from_ntp: bool, sampler: Sampler) -> SBDDecoder:
    return SBDDecoder(block_size, make_policy(policy, gamma), sampler, first_token_from_ntp)
