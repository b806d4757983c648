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
than one forward per token (out of domain they did: docs/notes/2026-11-decoding-step-cost.md). A row may therefore spend
a drafting forward only while it has committed more tokens than it has spent forwards; otherwise
its block is drafted in one go from the predictions already at hand (the verify forward's greedy
predictions past the correction, Jacobi-style, then its mask predictions), and goes straight to
verification. Every verification commits at least one token, so TPF never falls below 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, register, reveal_policy, sampling
from fastforward.decoding.policies import Policy, greedy_prefix
from fastforward.decoding.runtime import Row, Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import carried_and_masks, commit_writes, first_tokens, masked_before_stop, row_tokens


@dataclass
class VerifiedState:
    """A row's block: `draft`, its tokens (None: masked; slot 0 is the last committed token, exact), and
    `start`, the canvas position of slot 0."""

    draft: list[int | None]
    start: int


@register(
    "sbd-verified",
    summary="SBD blocks as drafts, verified by next-token logits in the commit forward; TPF >= 1",
    lossless=True,
    needs_mask=True,
)
@dataclass(eq=False)
class VerifiedSBDDecoder(Decoder):
    """Blocks of `block_size` (an exact first token, then masks revealed by `policy`), verified.

    A row whose draft (`VerifiedState`) still has masked positions drafts in a step (`[draft]`,
    bidirectional, nothing kept); a row whose draft is full verifies (`[draft (causal) ; next block's
    masks]`). Rows of one forward may do either, so they never wait for each other, and join and
    leave between steps.
    """

    block_size: int = BLOCK_SIZE.field()
    policy: Policy = reveal_policy()
    sampler: Sampler = sampling()

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        """New rows commit the prefill's next token (exact) and open their first block at it."""
        first = first_tokens(session, rows)
        for index in rows:
            row = session.rows[index]
            row.state = VerifiedState([first[index]] + [None] * (self._size(session, row, 0) - 1), row.frontier - 1)

    def step(self, session: Session) -> None:
        """One forward. A drafting row reads its block and the policy reveals some of it; a verifying
        row runs its draft causally, commits the drafts its next-token predictions confirm and the
        exact token after them, and opens its next block there (revealed from this forward's masks
        when the whole draft held); a row out of credit then fills its draft at once."""
        mask_id = session.model.require_mask_token(self.name)
        rows, states = session.rows, [row.state for row in session.rows]
        masked = [
            [] if row.finished else masked_before_stop(state.draft, row.stops)
            for row, state in zip(rows, states, strict=True)
        ]
        verifying = [not row.finished and not any(m) for row, m in zip(rows, masked, strict=True)]
        # per row: the draft to verify, the positions read as a block, and the tokens known there
        carried, region, known = [], [], []
        for row, state, verifies in zip(rows, states, verifying, strict=True):
            start, draft = state.start, state.draft
            if verifies:
                carried.append([(start + i, mask_id if t is None else t) for i, t in enumerate(draft)])
                end = start + len(draft)
                region.append(list(range(end, end + self._size(session, row, len(draft) - 1))))
                known.append([None] * len(region[-1]))
            else:
                carried.append([])
                region.append(list(range(start, start + len(draft))) if not row.finished else [])
                known.append(draft if not row.finished else [])
        tokens, positions, rule, width = carried_and_masks(session, carried, region, mask_id, True, known)
        logits = session.forward(tokens, positions, rule, range(tokens.shape[1]))
        own = session.sampler.sample(logits[:, width:], positions[:, width:]).tolist()  # each block slot's token
        guesses = [[] for _ in rows]  # guesses[r][i]: the token after draft slot i (exact up to a mismatch)
        if width:
            guesses = session.sampler.sample(logits[:, :width], positions[:, :width] + 1).tolist()
        writes, keep = [[] for _ in rows], [0] * session.batch
        fallback: list[list[int]] = list(own)  # what a row out of credit drafts
        size = tokens.shape[1] - width
        reveal_from = [[False] * size for _ in rows]  # the masks this forward's block logits may reveal
        for index, (row, state) in enumerate(zip(rows, states, strict=True)):
            if row.finished:
                continue
            if not verifying[index]:
                reveal_from[index][: len(masked[index])] = masked[index]
                continue
            start, draft, guess = state.start, state.draft, guesses[index][: len(state.draft)]
            accepted = greedy_prefix(draft[1:], guess)
            writes[index] = [(start + 1 + i, guess[i]) for i in range(accepted + 1)]  # drafts held, next token
            keep[index] = accepted + 1  # in the cache: the exact first token and the drafts held
            following = len(region[index])
            predicted = guess + own[index][1:following]  # predicted[j]: the best guess at canvas start + j + 1
            fallback[index] = predicted[accepted : accepted + following]
            state.start, state.draft = start + accepted + 1, [fallback[index][0]] + [None] * (following - 1)
            if accepted == len(draft) - 1:  # the whole draft held: this forward's masks saw the right context
                reveal_from[index][:following] = masked_before_stop(state.draft, row.stops)
        commit_writes(session, writes)
        session.advance(keep=keep)
        self._reveal(session, logits[:, width:], reveal_from, own)
        for row, state, guess in zip(rows, states, fallback, strict=True):
            if not row.finished and row.length - row.forwards < 1:
                # as many forwards as tokens: the rest of the draft at once, from the best guesses at hand
                for slot, still in enumerate(masked_before_stop(state.draft, row.stops)):
                    if still:
                        state.draft[slot] = guess[slot]

    def _reveal(
        self, session: Session, logits: torch.Tensor, candidates: list[list[bool]], own: list[list[int]]
    ) -> None:
        """Fill the draft positions the policy picks among `candidates` (a row's masked block slots
        whose logits this forward read in context) with their tokens `own` (greedy, or sampled with each
        position's draw)."""
        reveal = self.policy(logits, torch.tensor(candidates, device=session.device)).tolist()
        for row, shown, tokens in zip(session.rows, reveal, own, strict=True):
            draft = row.state.draft
            for slot, chosen in enumerate(shown[: len(draft)]):
                if chosen:
                    draft[slot] = tokens[slot]

    def _size(self, session: Session, row: Row, drafted: int) -> int:
        """Size of a row's next block: whole, unless the row has fewer tokens left (`drafted` of them
        in a draft being verified), and at least its exact first token. Under the server's bound on
        a forward's tokens (`steps.row_tokens`) blocks shrink while many rows share a forward: a
        verifying row runs its draft and the next block, two blocks' worth (the output is the same)."""
        bound = row_tokens(session)
        block = self.block_size if bound is None else max(1, min(self.block_size, bound // 2))
        return min(block, max(1, row.limit - row.frontier - drafted + 1))
