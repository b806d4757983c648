"""Jacobi decoding with several blocks and rejection recycling (Jacobi Forcing, Algorithm 1).

One forward holds `[last committed token ; draft chain ; candidates]`:

* the draft chain is the real-active block (its remaining drafts) followed by up to K − 1
  pseudo-active blocks of n drafts that keep refining ahead of it (causal, one chain), and never
  shorter than plain Jacobi's n drafts;
* candidates are n-grams recycled from earlier rejected drafts that start where the committed
  text ends; each sees only the cache, the last token and itself.

Whichever of the chain or the candidates has the longest greedily confirmed prefix is committed,
with the prediction after it, so the output is exactly greedy AR decoding. A new pseudo-active
block is spawned once a block has ⌈r·n⌉ confirmed (or stationary) tokens. Rows of a batch are
decoded one after another: their candidate layouts differ.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

import torch

from fastforward.decoders.base import Decoder, Generation, Session
from fastforward.errors import FastForwardError
from fastforward.model import Model


class NgramPool:
    """Recent n-grams seen in rejected drafts, keyed by their first token (most recent first)."""

    def __init__(self, per_key: int):
        self.grams: dict[int, deque[tuple[int, ...]]] = defaultdict(lambda: deque(maxlen=per_key))

    def add_rejected(self, drafts: list[int], accepted: int, length: int) -> None:
        for i in range(accepted, len(drafts) - 1):
            gram = tuple(drafts[i + 1 : i + 1 + length])
            bucket = self.grams[drafts[i]]
            if gram not in bucket:
                bucket.appendleft(gram)

    def candidates(self, token: int, limit: int) -> list[list[int]]:
        return [list(g) for g in list(self.grams.get(token, ()))[:limit]]


def _confirmed(drafts: list[int], predictions: list[int]) -> int:
    """Length of the prefix of `drafts` that equals the greedy predictions made before each draft."""
    count = 0
    for d, g in zip(drafts, predictions, strict=False):
        if d != g:
            break
        count += 1
    return count


class MultiBlockJacobiDecoder(Decoder):
    """Lossless multi-block Jacobi decoding with rejection recycling.

    block_size n, max_blocks K, spawn_ratio r, verify: n-gram candidates checked per forward,
    ngram: candidate length (default n).
    """

    name = "jacobi-mr"

    def __init__(
        self, block_size: int = 16, max_blocks: int = 2, spawn_ratio: float = 0.85, verify: int = 2, ngram: int = 0
    ):
        if block_size <= 0:
            raise FastForwardError(f"block size must be > 0, got {block_size}")
        if max_blocks < 1 or verify < 0 or not 0 < spawn_ratio <= 1:
            raise FastForwardError("need max_blocks >= 1, verify >= 0 and 0 < spawn_ratio <= 1")
        self.n, self.max_blocks, self.verify = block_size, max_blocks, verify
        self.spawn_at = math.ceil(spawn_ratio * block_size)
        self.ngram = ngram or block_size

    def generate(self, model: Model, prompts: list[list[int]], max_new_tokens: int = 256) -> list[Generation]:
        one_row = super().generate
        return [one_row(model, [prompt], max_new_tokens)[0] for prompt in prompts]

    def new_pool(self) -> NgramPool:
        """The candidate pool for one prompt (empty; a subclass may seed it, e.g. from the prompt)."""
        return NgramPool(per_key=max(self.verify, 1))

    def decode(self, session: Session) -> None:
        n = self.n
        pool = self.new_pool()
        last = int(session.next_logits[0].argmax())
        session.finish_rows(torch.tensor([[last]], device=session.device), torch.ones(1, dtype=torch.long))
        drafts, ra_left, pseudo = [last] * n, n, 0
        while not bool(session.done[0]):
            cands = pool.candidates(last, self.verify)
            guess = self._forward(session, last, drafts, cands)
            chain = guess[: len(drafts) + 1]  # chain[i]: prediction after the i-th chain token
            accepted = _confirmed(drafts, chain)
            preds = dict(enumerate(chain))  # preds[i]: the token predicted i + 1 positions after `last`
            picks = list(range(accepted + 1))
            start = len(drafts) + 1
            for cand in cands:
                cand_preds = [chain[0], *guess[start : start + len(cand) - 1]]
                got = _confirmed(cand, cand_preds)
                if got > accepted:
                    accepted = got
                    picks = [0, *range(start, start + got)]
                    preds.update({i: t for i, t in enumerate([*cand_preds, guess[start + len(cand) - 1]])})
                start += len(cand)
            pool.add_rejected(drafts, _confirmed(drafts, chain), self.ngram)
            committed = [preds[i] for i in range(accepted + 1)]
            session.count_forward()
            session.record_step([accepted + 1])
            session.keep_picked(len(guess), torch.tensor(picks, device=session.device))
            session.finish_rows(torch.tensor([committed], device=session.device), torch.tensor([accepted + 1]))
            session.next_pos += accepted + 1
            last = committed[-1]
            stationary = _confirmed(drafts[-n:], chain[len(drafts) - n : len(drafts)]) if pseudo else accepted
            ra_left -= accepted + 1
            while ra_left <= 0:  # the real-active block is done: promote the next block (or start one)
                ra_left += n
                pseudo = max(pseudo - 1, 0)
            if stationary >= self.spawn_at and pseudo + 1 < self.max_blocks:
                pseudo += 1
            want = max(ra_left + n * pseudo, n)  # never fewer drafts than plain Jacobi
            ahead = [preds[i] for i in range(accepted + 1, len(preds))]
            drafts = (ahead + [last] * want)[:want]

    def _forward(self, session: Session, last: int, drafts: list[int], cands: list[list[int]]) -> list[int]:
        """Greedy predictions for every token of `[last ; drafts ; candidates]` (all entries kept)."""
        chain = 1 + len(drafts)
        total = chain + sum(len(c) for c in cands)
        rule = torch.zeros(total, total, dtype=torch.bool, device=session.device)
        rule[:chain, :chain] = True
        offsets = list(range(chain))
        start = chain
        for cand in cands:
            end = start + len(cand)
            rule[start:end, 0] = True
            rule[start:end, start:end] = True
            offsets += range(1, len(cand) + 1)
            start = end
        rule = rule.tril()  # causal within the chain and within each candidate
        tokens = torch.tensor([[last, *drafts, *(t for c in cands for t in c)]], device=session.device)
        positions = session.next_pos[:, None] + torch.tensor(offsets, device=session.device)[None]
        logits = session.run(tokens, positions, rule, read=list(range(total)), keep=total)
        return logits[0].argmax(-1).tolist()
