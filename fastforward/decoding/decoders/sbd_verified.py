"""SBD drafting, next-token verification: the SBD model's AR output in fewer forwards.

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
forwards spent per draft against how much of a draft survives verification. With a sampler, drafts
and next-token predictions are sampled with each position's own draw, and a draft is kept while it
equals the sampled prediction (speculative sampling with a one-hot draft,
`fastforward.decoding.sampling`): the output is AR sampling's, token for token, for the same seed.

Forwards that only reveal commit nothing, so drafts that keep failing verification could cost more
than one forward per token (out of domain, TPF fell to 0.29 at γ = 0.1). A row may therefore spend
a drafting forward only while it has committed more tokens than it has spent forwards; otherwise
its block is drafted in one go from the predictions already at hand (the verify forward's greedy
predictions past the correction, Jacobi-style, then its mask predictions), and goes straight to
verification. Every verification commits at least one token, so TPF never falls below 1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, GAMMA, POLICY, SAMPLING, register
from fastforward.decoding.policies import EntropyBounded, greedy_prefix, make_policy
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


class VerifiedSBDDecoder(Decoder):
    """Blocks of `block_size` (an exact first token, then masks revealed by `policy`), verified."""

    name = "sbd-verified"

    def __init__(self, block_size: int = 16, policy=None, sampler: Sampler | None = None):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.policy = policy or EntropyBounded(0.35)
        self.sampler = sampler or Sampler()

    def decode(self, session: Session) -> None:
        mask_id = session.model.require_mask_token(self.name)
        first = session.sample(session.next_logits, session.next_pos)
        session.append(first[:, None])
        block, masked = self._open(session, first[:, None], self._size(session, 0), mask_id)
        while not session.finished:
            start = session.next_pos - 1  # block[:, 0], the last committed token, sits here
            size = block.shape[1]
            positions = start[:, None] + torch.arange(size, device=session.device)
            rule = visibility.sbd_decode(0, size, session.device)
            while still_masked(session, masked):
                drafting = masked.any(-1) & ~session.done
                logits = session.forward(block, positions, rule, read=range(size), rows=drafting)
                session.advance(keep=0)  # drafts only: nothing is committed yet
                block, masked = self._reveal(session, logits, block, masked)
                block, masked = self._fill_if_broke(session, block, masked, partial(session.sample, logits, positions))
            block, masked = self._verify(session, block, start, mask_id)

    def _size(self, session: Session, drafted: int) -> int:
        """Size of the next block: whole, unless the furthest running row has fewer tokens left.

        Rows drift apart (each keeps its own share of a draft), so finished rows must not count."""
        return min(self.block_size, max(1, session.max_new_tokens - session.produced - drafted + 1))

    def _open(
        self, session: Session, tokens: torch.Tensor, size: int, mask_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block starting at each row's exact next token `tokens[:, 0]`, its other positions masked."""
        block = torch.full((session.batch, size), mask_id, dtype=torch.long, device=session.device)
        block[:, 0] = tokens[:, 0]
        masked = torch.ones_like(block, dtype=torch.bool)
        masked[:, 0] = False
        return block, masked & ~after_stop(block, masked, session.stop_ids)

    def _reveal(
        self, session: Session, logits: torch.Tensor, block: torch.Tensor, masked: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the positions the policy picks with their tokens (greedy, or sampled with each
        position's draw); nothing after a stop token. block[:, 0] sits at the last committed token."""
        reveal = self.policy(logits, masked)
        at = session.next_pos[:, None] - 1 + torch.arange(block.shape[1], device=session.device)
        block = torch.where(reveal, session.sample(logits, at), block)
        masked = masked & ~reveal
        return block, masked & ~after_stop(block, masked, session.stop_ids)

    def _fill_if_broke(
        self, session: Session, block: torch.Tensor, masked: torch.Tensor, predicted: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows that have spent as many forwards as they committed tokens draft the rest of their
        block from `predicted()` (the best tokens at hand) at once, so their next forward verifies."""
        credit = [n - f for n, f in zip(session.lengths, session.forwards, strict=True)]
        if min(credit) >= 1:
            return block, masked
        broke = torch.tensor([c < 1 for c in credit], device=session.device)[:, None] & masked
        block = torch.where(broke, predicted(), block)
        masked = masked & ~broke
        return block, masked & ~after_stop(block, masked, session.stop_ids)

    def _verify(
        self, session: Session, draft: torch.Tensor, start: torch.Tensor, mask_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of `[draft (causal, kept) ; next block (masks)]`: commit the verified prefix of
        the draft and the exact token after it, and open the next block at that token."""
        size = draft.shape[1]
        following = self._size(session, size - 1)
        total = size + following
        tokens = torch.cat([draft, draft.new_full((session.batch, following), mask_id)], dim=1)
        positions = start[:, None] + torch.arange(total, device=session.device)
        rule = visibility.sbd_decode(size, following, session.device)
        logits = session.forward(tokens, positions, rule, read=range(total))
        guess = session.sample(logits[:, :size], positions[:, :size] + 1)  # guess[:, i]: the token after draft[:, i]
        accepted = greedy_prefix(draft[:, 1:], guess[:, : size - 1])
        session.append(guess, accepted + 1)  # the confirmed drafts and the exact token after them
        session.advance(keep=accepted + 1)  # the exact first token and its confirmed drafts
        # predicted[:, i]: the best guess at position start + i + 1 (after the draft, then masks)
        masks = session.sample(logits[:, size + 1 :], positions[:, size + 1 :])
        predicted = torch.cat([guess, masks], dim=1)
        following_slots = accepted[:, None] + torch.arange(following, device=session.device)
        carried = predicted.gather(1, following_slots)
        block, masked = self._open(session, carried, following, mask_id)
        # Where the whole draft was accepted, the masks of this forward saw the right context.
        whole = (accepted == size - 1)[:, None]
        revealed, still = self._reveal(session, logits[:, size:], block, masked & whole)
        block, masked = torch.where(whole, revealed, block), torch.where(whole, still, masked)
        return self._fill_if_broke(session, block, masked, lambda: carried)


@register(
    "sbd-verified",
    knobs=(BLOCK_SIZE, POLICY, GAMMA, *SAMPLING),
    summary="SBD blocks as drafts, verified by next-token logits in the commit forward; TPF >= 1",
    lossless=True,
    needs_mask=True,
)
def _build(block_size: int, policy: str, gamma: float, sampler: Sampler) -> VerifiedSBDDecoder:
    return VerifiedSBDDecoder(block_size, make_policy(policy, gamma), sampler)
