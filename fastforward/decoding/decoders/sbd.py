"""Set Block Decoding (SBD paper, Algorithms 2 and 3) with an exact KV cache.

Each block starts as k mask tokens. A forward reads the whole block (it sees the cache and itself
bidirectionally); a reveal policy picks which masked positions to fill. When the block is full it
is not written to the cache at once: it rides along, causally, in front of the next block's first
forward (the paper's time(2k) term) and only those entries are kept, so the cache always holds
exactly what a causal prefill of the same tokens would. Each row keeps its own block (its canvas
positions), so rows of a batch move through their blocks apart, spend no forward waiting for the
others' blocks, and join and leave between steps (the server batches it so). With a
sampler at temperature > 0 each revealed position's token is sampled from its predicted
distribution (with the position's own draw, `fastforward.decoding.sampling`); the policy still
decides which positions on the model's distributions, so temperature 0 is greedy SBD, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, FIRST_TOKEN_FROM_NTP, register, reveal_policy, sampling
from fastforward.decoding.policies import Policy
from fastforward.decoding.runtime import Row, Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import (
    carried_and_masks,
    commit_writes,
    first_tokens,
    masked_before_stop,
    next_block,
    next_token_logits,
)


@dataclass
class SBDState:
    block: list[int]  # the canvas positions of the row's open block
    carried: list[tuple[int, int]] = field(default_factory=list)  # the full block before it, until cached


@register("sbd", summary="Set Block Decoding: blocks of masks revealed by a policy, exact KV cache", needs_mask=True)
@dataclass(eq=False)
class SBDDecoder(Decoder):
    """Blocks of `block_size` masks, revealed by `policy` (default: entropy-bounded, γ = 0.35).

    first_token_from_ntp: take each block's first token from the next-token prediction of the
    last committed token, which the commit forward (or the prefill) computes anyway.
    """

    block_size: int = BLOCK_SIZE.field()
    policy: Policy = reveal_policy()
    sampler: Sampler = sampling()
    first_token_from_ntp: bool = FIRST_TOKEN_FROM_NTP.field()

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        """New rows open their first block; with `first_token_from_ntp` its first token is the
        prefill's next-token prediction, known before the block's first forward."""
        for index in rows:
            row = session.rows[index]
            row.state = SBDState(next_block(row, self.block_size))
        if self.first_token_from_ntp:
            first_tokens(session, rows)

    def step(self, session: Session) -> None:
        """One forward of every running row's `[finished block (kept, causal) ; its block (read)]`, then
        the policy reveals some of each block's masked positions. A row whose block is full carries it
        into the next forward and opens the next block."""
        mask_id = session.model.require_mask_token(self.name)
        states: list[SBDState] = [row.state for row in session.rows]
        for row, state in zip(session.rows, states, strict=True):  # a full block rides along; the next opens
            if not row.finished and not any(self._masked(row, state.block, 0)):
                state.carried = [(p, row.canvas[p]) for p in state.block]
                state.block = next_block(row, self.block_size)
        carried = [state.carried for state in states]
        live = [state.block if not row.finished else [] for row, state in zip(session.rows, states, strict=True)]
        revealed = [[row.canvas[p] for p in block] for row, block in zip(session.rows, live, strict=True)]
        tokens, positions, rule, width = carried_and_masks(session, carried, live, mask_id, True, revealed)
        ntp, device, size = self.first_token_from_ntp, session.device, tokens.shape[1] - width
        read = range(0 if ntp else width, tokens.shape[1])
        logits = session.forward(tokens, positions, rule, read)
        masked = [self._masked(row, block, size) for row, block in zip(session.rows, live, strict=True)]
        masked = torch.tensor(masked, device=device)
        at = positions[:, width:]
        if ntp:  # a block not begun yet takes its first token from the NTP head at the last carried token
            first = next_token_logits(session, logits, carried)
            logits = logits[:, width:]
            fresh = masked[:, 0] & torch.tensor([bool(c) for c in carried], device=device)
            masked[:, 0] &= ~fresh
        reveal = self.policy(logits, masked)
        chosen = session.sampler.sample(logits, at)
        if ntp:
            chosen[:, 0] = torch.where(fresh, session.sampler.sample(first, at[:, 0]), chosen[:, 0])
            reveal[:, 0] |= fresh
        writes, shown = chosen.tolist(), reveal.tolist()
        commit_writes(
            session, [[(p, writes[r][i]) for i, p in enumerate(block) if shown[r][i]] for r, block in enumerate(live)]
        )
        session.advance(keep=[len(c) for c in carried])
        for state in states:
            state.carried = []  # in the cache now

    @staticmethod
    def _masked(row: Row, block: list[int], size: int) -> list[bool]:
        """The block's positions still to reveal (`masked_before_stop`), padded to `size`."""
        return masked_before_stop([row.canvas[p] for p in block], row.stops) + [False] * (size - len(block))
