"""Set Block Decoding (SBD paper, Algorithms 2 and 3) with an exact KV cache.

Each block starts as k mask tokens. A forward reads the whole block (it sees the cache and itself
bidirectionally); a reveal policy picks which masked positions to fill. When the block is full it
is not written to the cache at once: it rides along, causally, in front of the next block's first
forward (the paper's time(2k) term) and only those entries are kept, so the cache always holds
exactly what a causal prefill of the same tokens would. Each row keeps its own block (its canvas
positions), so rows of a batch move through their blocks apart, spend no forward waiting for the
others' blocks, and join and leave between steps (`continuous`: the server batches it so). With a
sampler at temperature > 0 each revealed position's token is sampled from its predicted
distribution (with the position's own draw, `fastforward.decoding.sampling`); the policy still
decides which positions on the model's distributions, so temperature 0 is greedy SBD, unchanged.
"""

from __future__ import annotations

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, FIRST_TOKEN_FROM_NTP, GAMMA, POLICY, SAMPLING, register
from fastforward.decoding.decoders.setdlm import carried_and_masks, commit_writes, next_token_logits
from fastforward.decoding.policies import EntropyBounded, make_policy
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError


class SBDDecoder(Decoder):
    """Blocks of `block_size` masks, revealed by `policy` (default: entropy-bounded, γ = 0.35).

    first_token_from_ntp: take each block's first token from the next-token prediction of the
    last committed token, which the commit forward (or the prefill) computes anyway.
    """

    name = "sbd"
    continuous = True  # per-row blocks: rows join and leave between steps (the server batches it so)

    def __init__(
        self, block_size: int = 16, policy=None, sampler: Sampler | None = None, first_token_from_ntp: bool = False
    ):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.policy = policy or EntropyBounded(0.35)
        self.sampler = sampler or Sampler()
        self.first_token_from_ntp = first_token_from_ntp

    def begin(self, session: Session, rows: range) -> None:
        """New rows open their first block; with `first_token_from_ntp` its first token is the
        prefill's next-token prediction, known before the block's first forward. Per row: `block`,
        the canvas positions of its open block, and `carried`, the full block before it while the
        next forward brings it into the cache."""
        carried, blocks = session.per_row("carried"), session.per_row("block")
        for row in rows:
            carried[row], blocks[row] = [], self._block(session, row)
        if self.first_token_from_ntp:
            session.commit_next_tokens(rows)

    def step(self, session: Session) -> None:
        """One forward of every running row's `[finished block (kept, causal) ; its block (read)]`, then
        the policy reveals some of each block's masked positions. A row whose block is full carries it
        into the next forward and opens the next block."""
        mask_id = session.model.require_mask_token(self.name)
        carried: list[list[tuple[int, int]]] = session.per_row("carried")
        blocks: list[list[int]] = session.per_row("block")
        running = [not done for done in session.finished_rows]
        for row in range(session.batch):  # a full block rides along in this forward; the next one opens
            if running[row] and not any(self._masked(session, row, blocks[row], 0)):
                carried[row] = [(p, session.canvas[row][p]) for p in blocks[row]]
                blocks[row] = self._block(session, row)
        live = [blocks[row] if running[row] else [] for row in range(session.batch)]
        revealed = [[session.canvas[row][p] for p in block] for row, block in enumerate(live)]
        tokens, positions, rule, width = carried_and_masks(session, carried, live, mask_id, True, revealed)
        ntp, device, size = self.first_token_from_ntp, session.device, tokens.shape[1] - width
        read = range(0 if ntp else width, tokens.shape[1])
        logits = session.forward(tokens, positions, rule, read, rows=torch.tensor(running))
        masked = [self._masked(session, row, block, size) for row, block in enumerate(live)]
        masked = torch.tensor(masked, device=device)
        at = positions[:, width:]
        if ntp:  # a block not begun yet takes its first token from the NTP head at the last carried token
            first = next_token_logits(session, logits, carried)
            logits = logits[:, width:]
            fresh = masked[:, 0] & torch.tensor([bool(c) for c in carried], device=device)
            masked[:, 0] &= ~fresh
        reveal = self.policy(logits, masked)
        chosen = session.sample(logits, at)
        if ntp:
            chosen[:, 0] = torch.where(fresh, session.sample(first, at[:, 0]), chosen[:, 0])
            reveal[:, 0] |= fresh
        writes, shown = chosen.tolist(), reveal.tolist()
        commit_writes(
            session, [[(p, writes[r][i]) for i, p in enumerate(block) if shown[r][i]] for r, block in enumerate(live)]
        )
        session.advance(keep=[len(c) for c in carried])
        carried[:] = [[] for _ in carried]  # in the cache now

    def _block(self, session: Session, row: int) -> list[int]:
        start = session.frontiers[row]
        return list(range(start, min(start + self.block_size, session.limits[row])))

    @staticmethod
    def _masked(session: Session, row: int, block: list[int], size: int) -> list[bool]:
        """The block's positions still to reveal, padded to `size`: none after a revealed stop token
        (the output is cut there, so no forward is worth spending on them)."""
        canvas, stop = session.canvas[row], session.first_stops[row]
        return [canvas[p] is None and p < stop for p in block] + [False] * (size - len(block))


@register(
    "sbd",
    knobs=(BLOCK_SIZE, POLICY, GAMMA, FIRST_TOKEN_FROM_NTP, *SAMPLING),
    summary="Set Block Decoding: blocks of masks revealed by a policy, exact KV cache",
    needs_mask=True,
)
def _build(block_size: int, policy: str, gamma: float, first_token_from_ntp: bool, sampler: Sampler) -> SBDDecoder:
    return SBDDecoder(block_size, make_policy(policy, gamma), sampler, first_token_from_ntp)
