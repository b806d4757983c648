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

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, GAMMA, POLICY, SAMPLING, register
from fastforward.decoding.decoders.setdlm import carried_and_masks, commit_writes
from fastforward.decoding.policies import EntropyBounded, greedy_prefix, make_policy
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError


class VerifiedSBDDecoder(Decoder):
    """Blocks of `block_size` (an exact first token, then masks revealed by `policy`), verified.

    Per row (`session.per_row`): `draft`, its block's tokens (None: masked; slot 0 is the last
    committed token, exact), and `start`, the canvas position of slot 0. A row whose draft still has
    masked positions drafts in a step (`[draft]`, bidirectional, nothing kept); a row whose draft is
    full verifies (`[draft (causal) ; next block's masks]`). Rows of one forward may do either, so
    they never wait for each other, and join and leave between steps (`continuous`).
    """

    name = "sbd-verified"
    continuous = True

    def __init__(self, block_size: int = 16, policy=None, sampler: Sampler | None = None):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.policy = policy or EntropyBounded(0.35)
        self.sampler = sampler or Sampler()

    def begin(self, session: Session, rows: range) -> None:
        """New rows commit the prefill's next token (exact) and open their first block at it."""
        first = session.commit_next_tokens(rows)
        drafts, starts = session.per_row("draft"), session.per_row("start")
        for row in rows:
            starts[row] = session.frontiers[row] - 1
            drafts[row] = [first[row]] + [None] * (self._size(session, row, 0) - 1)

    def step(self, session: Session) -> None:
        """One forward. A drafting row reads its block and the policy reveals some of it; a verifying
        row runs its draft causally, commits the drafts its next-token predictions confirm and the
        exact token after them, and opens its next block there (revealed from this forward's masks
        when the whole draft held); a row out of credit then fills its draft at once."""
        mask_id = session.model.require_mask_token(self.name)
        drafts: list[list[int | None]] = session.per_row("draft")
        starts: list[int] = session.per_row("start")
        running = [not done for done in session.finished_rows]
        masked = [_masked(drafts[r], session.stop_sets[r]) if running[r] else [] for r in range(session.batch)]
        verifying = [running[r] and not any(masked[r]) for r in range(session.batch)]
        # per row: the draft to verify, the positions read as a block, and the tokens known there
        carried, region, known = [], [], []
        for row, (start, draft) in enumerate(zip(starts, drafts, strict=True)):
            if verifying[row]:
                carried.append([(start + i, mask_id if t is None else t) for i, t in enumerate(draft)])
                end = start + len(draft)
                region.append(list(range(end, end + self._size(session, row, len(draft) - 1))))
                known.append([None] * len(region[-1]))
            else:
                carried.append([])
                region.append(list(range(start, start + len(draft))) if running[row] else [])
                known.append(draft if running[row] else [])
        tokens, positions, rule, width = carried_and_masks(session, carried, region, mask_id, True, known)
        logits = session.forward(tokens, positions, rule, range(tokens.shape[1]))
        own = session.sample(logits[:, width:], positions[:, width:]).tolist()  # each block slot's token
        guesses = [[] for _ in drafts]  # guesses[r][i]: the token after draft slot i (exact up to a mismatch)
        if width:
            guesses = session.sample(logits[:, :width], positions[:, :width] + 1).tolist()
        writes, keep = [[] for _ in drafts], [0] * session.batch
        fallback: list[list[int]] = [own[row] for row in range(session.batch)]  # what a broke row drafts
        size = tokens.shape[1] - width
        reveal_from = [[False] * size for _ in drafts]  # the masks this forward's block logits may reveal
        for row in range(session.batch):
            if not running[row]:
                continue
            if not verifying[row]:
                reveal_from[row][: len(masked[row])] = masked[row]
                continue
            start, draft, guess = starts[row], drafts[row], guesses[row][: len(drafts[row])]
            accepted = greedy_prefix(draft[1:], guess)
            writes[row] = [(start + 1 + i, guess[i]) for i in range(accepted + 1)]  # the drafts held, the next token
            keep[row] = accepted + 1  # in the cache: the exact first token and the drafts held
            following = len(region[row])
            predicted = guess + own[row][1:following]  # predicted[j]: the best guess at canvas start + j + 1
            fallback[row] = predicted[accepted : accepted + following]
            starts[row], drafts[row] = start + accepted + 1, [fallback[row][0]] + [None] * (following - 1)
            if accepted == len(draft) - 1:  # the whole draft held: this forward's masks saw the right context
                reveal_from[row][:following] = _masked(drafts[row], session.stop_sets[row])
        commit_writes(session, writes)
        session.advance(keep=keep)
        self._reveal(session, logits[:, width:], reveal_from, own)
        for row in range(session.batch):
            if not session.finished_rows[row] and session.lengths[row] - session.forwards[row] < 1:
                # as many forwards as tokens: the rest of the draft at once, from the best guesses at hand
                for slot, still in enumerate(_masked(drafts[row], session.stop_sets[row])):
                    if still:
                        drafts[row][slot] = fallback[row][slot]

    def _reveal(
        self, session: Session, logits: torch.Tensor, candidates: list[list[bool]], own: list[list[int]]
    ) -> None:
        """Fill the draft positions the policy picks among `candidates` (a row's masked block slots
        whose logits this forward read in context) with their tokens `own` (greedy, or sampled with each
        position's draw)."""
        reveal = self.policy(logits, torch.tensor(candidates, device=session.device)).tolist()
        for draft, shown, tokens in zip(session.per_row("draft"), reveal, own, strict=True):
            for slot, chosen in enumerate(shown[: len(draft or ())]):
                if chosen:
                    draft[slot] = tokens[slot]

    def _size(self, session: Session, row: int, drafted: int) -> int:
        """Size of a row's next block: whole, unless the row has fewer tokens left (`drafted` of them
        in a draft being verified), and at least its exact first token. Under the server's bound on
        a forward's tokens (`Session.row_tokens`) blocks shrink while many rows share a forward: a
        verifying row runs its draft and the next block, two blocks' worth (the output is the same)."""
        row_tokens = session.row_tokens()
        block = self.block_size if row_tokens is None else max(1, min(self.block_size, row_tokens // 2))
        return min(block, max(1, session.limits[row] - session.frontiers[row] - drafted + 1))


def _masked(draft: list[int | None], stops: frozenset[int]) -> list[bool]:
    """A draft's positions still to reveal: none after a revealed stop token (the output is cut there,
    so no forward is worth spending on them)."""
    out, stopped = [], False
    for token in draft:
        out.append(token is None and not stopped)
        stopped = stopped or (token is not None and token in stops)
    return out


@register(
    "sbd-verified",
    knobs=(BLOCK_SIZE, POLICY, GAMMA, *SAMPLING),
    summary="SBD blocks as drafts, verified by next-token logits in the commit forward; TPF >= 1",
    lossless=True,
    needs_mask=True,
)
def _build(block_size: int, policy: str, gamma: float, sampler: Sampler) -> VerifiedSBDDecoder:
    return VerifiedSBDDecoder(block_size, make_policy(policy, gamma), sampler)
