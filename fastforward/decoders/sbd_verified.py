"""SBD drafting, next-token verification: the SBD model's greedy AR output in fewer forwards.

Plain SBD decoding (`sbd.py`) keeps whatever its reveal policy picks, so its output can leave the
model's own greedy NTP-mode output (eq. 9a): every forced or wrong reveal is kept. Here a finished
block is a *draft*. Its first token is always exact (the NTP prediction after the committed text);
the rest are revealed from masks by the policy, as in SBD. The draft then rides, causally, in front
of the next block's first forward, as SBD's commit forward already does, and that forward's
next-token logits at the draft's positions verify it: drafts are accepted while each equals the
greedy prediction after the token before it (as in Jacobi decoding), and the prediction after the
last accepted token is exact too, so it opens the next block. Only the accepted entries stay in the
cache (a crop). When the whole draft is accepted, the next block's mask predictions from that same
forward are valid and the policy reveals from them; otherwise the next block starts fresh from the
correction and that forward's mask predictions are dropped.

The output equals greedy AR decoding of the same model, whatever the policy and γ: they only trade
forwards spent per draft against how much of a draft survives verification.
"""

from __future__ import annotations

import torch

from fastforward import visibility
from fastforward.decoders.base import Decoder, Session
from fastforward.decoders.sbd import after_stop
from fastforward.errors import FastForwardError
from fastforward.policies import EntropyBounded


class VerifiedSBDDecoder(Decoder):
    """Blocks of `block_size` (an exact first token, then masks revealed by `policy`), verified."""

    name = "sbd-verified"

    def __init__(self, block_size: int = 16, policy=None):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.policy = policy or EntropyBounded(0.35)

    def decode(self, session: Session) -> None:
        mask_id = session.model.require_mask_token(self.name)
        first = session.next_logits.argmax(-1)
        session.finish_rows(first[:, None], torch.ones_like(first))
        block, masked = self._open(session, first, self._size(session, 0), mask_id)
        while not bool(session.done.all()):
            while bool((masked & ~session.done[:, None]).any()):
                size = block.shape[1]
                positions = session.next_pos[:, None] + torch.arange(size, device=session.device)
                rule = visibility.sbd_decode(0, size, session.device)
                logits = session.run(block, positions, rule, read=list(range(size)), keep=0)
                session.count_forward()
                session.record_step([0] * session.batch)  # drafts only: nothing is committed yet
                block, masked = self._reveal(session, logits, block, masked)
            block, masked = self._verify(session, block, mask_id)

    def _size(self, session: Session, drafted: int) -> int:
        """Size of the next block: whole, unless the furthest running row has fewer tokens left.

        Rows drift apart (each keeps its own share of a draft), so finished rows must not count."""
        lengths = [len(out) for out, done in zip(session.outputs, session.done.tolist(), strict=True) if not done]
        produced = max(lengths, default=session.max_new_tokens)
        return min(self.block_size, max(1, session.max_new_tokens - produced - drafted + 1))

    def _open(
        self, session: Session, first: torch.Tensor, size: int, mask_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block starting at each row's exact next token `first`, its other positions masked."""
        block = torch.full((session.batch, size), mask_id, dtype=torch.long, device=session.device)
        block[:, 0] = first
        masked = torch.ones_like(block, dtype=torch.bool)
        masked[:, 0] = False
        return block, masked & ~after_stop(block, masked, session.stop_ids)

    def _reveal(
        self, session: Session, logits: torch.Tensor, block: torch.Tensor, masked: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the positions the policy picks with their greedy tokens; nothing after a stop token."""
        reveal = self.policy(logits, masked)
        block = torch.where(reveal, logits.argmax(-1), block)
        masked = masked & ~reveal
        return block, masked & ~after_stop(block, masked, session.stop_ids)

    def _verify(self, session: Session, draft: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of `[draft (causal, kept) ; next block (masks)]`: commit the verified prefix of
        the draft and the exact token after it, and open the next block at that token."""
        size = draft.shape[1]
        following = self._size(session, size - 1)
        tokens = torch.cat([draft, draft.new_full((session.batch, following), mask_id)], dim=1)
        positions = session.next_pos[:, None] + torch.arange(size + following, device=session.device)
        rule = visibility.sbd_decode(size, following, session.device)
        logits = session.run(tokens, positions, rule, read=list(range(size + following)), keep=size)
        session.count_forward()
        guess = logits[:, :size].argmax(-1)  # guess[:, i]: the greedy token after draft[:, i]
        accepted = (draft[:, 1:] == guess[:, : size - 1]).long().cumprod(-1).sum(-1)
        session.keep_accepted(size, accepted + 1)  # the exact first token and its confirmed drafts
        session.record_step((accepted + 1).tolist())
        session.finish_rows(guess, accepted + 1)
        session.next_pos += accepted + 1
        block, masked = self._open(session, guess.gather(1, accepted[:, None])[:, 0], following, mask_id)
        # Where the whole draft was accepted, the masks of this forward saw the right context.
        whole = (accepted == size - 1)[:, None]
        revealed, still = self._reveal(session, logits[:, size:], block, masked & whole)
        return torch.where(whole, revealed, block), torch.where(whole, still, masked)
