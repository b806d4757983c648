"""Step code that decoders share, written against the runtime (`Session`) alone.

* Canvas writes: `append` (tokens at each row's frontier), `commit_writes` (per-row (position,
  token) writes), `first_tokens` (the prefill's prediction, sampled and committed); on the host, in
  the rows, so a step reads its tokens back once. `span`: RoPE positions from each row's frontier;
  `row_tokens`: a row's share of the server's bound on a forward's tokens (`Session.step_tokens`).
* `next_block`: a block's canvas positions from a row's frontier; `masked_before_stop`: which of a
  block's slots are still worth a forward (sbd, sbd-slide, sbd-verified).
* `carried_and_masks`: the layout `[carried tokens (kept, causal) ; masks (read)]` of the mask
  decoders (sbd, sbd-slide, sbd-verified, setdlm), padded per row, and `next_token_logits` at the
  last carried token.
* `chain_step`: one causal forward of `[last token ; drafts]` per row, accepting each row's confirmed
  prefix (jacobi, and lookup in a batch).
* `verify`: one forward of `[last token ; draft chain ; candidate n-grams]` per row, committing the
  contender with the longest confirmed prefix (jacobi-mr, and lookup alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastforward.decoding.policies import greedy_prefix
from fastforward.decoding.runtime import Row, Session
from fastforward.model import visibility


def append(session: Session, tokens: Sequence[Sequence[int]], count: Sequence[int] | None = None) -> None:
    """Commit each row's first `count[r]` (default: all) of `tokens[r]` at its frontier."""
    for index, (row, line) in enumerate(zip(session.rows, tokens, strict=True)):
        n = len(line) if count is None else count[index]
        row.write(list(enumerate(line[:n], row.frontier)))


def commit_writes(session: Session, writes: Sequence[Sequence[tuple[int, int]]]) -> None:
    """Each row's (position, token) writes onto its canvas (none once finished, none past its budget)."""
    for row, row_writes in zip(session.rows, writes, strict=True):
        if row_writes:
            row.write(row_writes)


def first_tokens(session: Session, rows: Sequence[int]) -> list[int]:
    """Sample the rows `rows` (just prefilled or joined) their first token from the prefill's next-token
    logits and commit it; returns every row's sample (a pure function of the row, so the other rows'
    are the same as theirs were)."""
    positions = torch.tensor([row.origin + row.frontier for row in session.rows], device=session.device)
    first = session.sampler.sample(session.next_logits, positions).tolist()
    starting = set(rows)
    append(session, [[t] for t in first], [int(row in starting) for row in range(session.batch)])
    return first


def span(session: Session, start: int, length: int) -> torch.Tensor:
    """RoPE positions [B, length] from `start` positions past each row's frontier (start -1: the last
    committed token), built on the host in one transfer."""
    firsts = [row.origin + row.frontier + start for row in session.rows]
    return torch.tensor([list(range(p, p + length)) for p in firsts], device=session.device)


def row_tokens(session: Session) -> int | None:
    """The tokens each running row may put in a forward under `session.step_tokens` (None: no bound)."""
    if session.step_tokens is None:
        return None
    return session.step_tokens // max(1, sum(not row.finished for row in session.rows))


def next_block(row: Row, size: int) -> list[int]:
    """The canvas positions of a block of `size` from the row's frontier, cut at its budget."""
    return list(range(row.frontier, min(row.frontier + size, row.limit)))


def masked_before_stop(tokens: Sequence[int | None], stops: frozenset[int]) -> list[bool]:
    """Which of a block's tokens (None: masked) are still to reveal: the masked ones before its first
    stop token. The output is cut at that stop, so no forward is worth spending on those after it."""
    masked, stopped = [], False
    for token in tokens:
        masked.append(token is None and not stopped)
        stopped = stopped or (token is not None and token in stops)
    return masked


def carried_and_masks(
    session: Session,
    carried: list[list[tuple[int, int]]],
    candidates: list[list[int]],
    mask_id: int,
    masks_see_masks: bool = False,
    known: list[list[int | None]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Tokens, positions and rule of `[carried (padded) ; candidate masks (padded)]`: the carried
    tokens causal in position order over the cache, each mask seeing the cache, the row's carried
    tokens and itself (with `masks_see_masks`, every real mask of its row too: SBD's block). known:
    per row, tokens already chosen at its candidate positions (None: a mask), which go in their place.
    The rule is per row [B, T, T], or SBD's shared [T, T] when `masks_see_masks` and no row is padded.
    Returns them with the carried width."""
    width = max(len(c) for c in carried)
    reads = max(1, max(len(c) for c in candidates))
    pad_id = session.model.pad_token_id
    ids, pos, clean_rank, mask_rank = [], [], [], []
    big = width + 1  # rank of a padded carried slot: after every real one, seen by no mask
    for index, (carry, cands) in enumerate(zip(carried, candidates, strict=True)):
        row = session.rows[index]
        block = [mask_id if t is None else t for t in known[index]] if known is not None else [mask_id] * len(cands)
        ids.append([t for _, t in carry] + [pad_id] * (width - len(carry)) + block + [mask_id] * (reads - len(cands)))
        filler = row.origin + (carry[-1][0] if carry else row.frontier)
        pos.append([row.origin + p for p, _ in carry] + [filler] * (width - len(carry)))
        pos[-1] += [row.origin + p for p in cands] + [filler] * (reads - len(cands))
        clean_rank.append(list(range(len(carry))) + [big + i for i in range(width - len(carry))])
        mask_rank.append([len(carry)] * reads)
    device = session.device
    tokens, positions = torch.tensor(ids, device=device), torch.tensor(pos, device=device)
    if masks_see_masks and all(len(c) == width for c in carried) and all(len(c) == reads for c in candidates):
        return tokens, positions, visibility.sbd_decode(width, reads, device), width
    rule = visibility.reveal_order(torch.tensor(clean_rank), torch.tensor(mask_rank))
    for index, (carry, cands) in enumerate(zip(carried, candidates, strict=True)):
        for slot in range(len(carry), width):  # a padded carried slot sees only itself
            rule[index, slot, :] = False
            rule[index, slot, slot] = True
        if masks_see_masks:
            rule[index, width : width + len(cands), width : width + len(cands)] = True
    return tokens, positions, rule.to(device), width


def next_token_logits(session: Session, logits: torch.Tensor, carried: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[B, V] each row's next-token prediction: from `logits` (read from slot 0 of a
    `carried_and_masks` layout) at its last carried token, or the prefill's when it carries none."""
    last = torch.tensor([len(c) - 1 for c in carried], device=session.device)
    at_last = logits[torch.arange(session.batch, device=session.device), last.clamp_min(0)]
    return torch.where((last >= 0)[:, None], at_last, session.next_logits)


def chain_step(session: Session, lasts: list[int], drafts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One causal forward of each row's `[last committed token ; drafts]` (drafts of one length); commits
    the drafts its predictions confirm and the prediction after them, and keeps their entries. Returns
    every slot's prediction (guesses[r][i]: the token after slot i) and how many drafts each row had
    confirmed. Decided on the host after one read-back of the predictions."""
    n = len(drafts[0])
    tokens = torch.tensor([[t, *d] for t, d in zip(lasts, drafts, strict=True)], device=session.device)
    positions = span(session, -1, n + 1)  # the last committed token, one position before the frontier
    logits = session.forward(tokens, positions, read=range(n + 1))
    guesses = session.sampler.sample(logits, positions + 1).tolist()
    accepted = [greedy_prefix(d, g) for d, g in zip(drafts, guesses, strict=True)]
    append(session, [g[: a + 1] for g, a in zip(guesses, accepted, strict=True)])  # confirmed + next
    session.advance(keep=[a + 1 for a in accepted])  # the last token and its confirmed drafts
    return guesses, accepted


@dataclass
class Verdict:
    """What one multi-block Jacobi forward decided for a row."""

    accepted: int  # tokens of the winning contender confirmed
    winner: int  # 0: the draft chain; i > 0: candidate i - 1
    chain_accepted: int  # of the draft chain's, confirmed
    stationary: int  # of the last block of the chain, confirmed against its own predictions
    committed: list[int]  # the confirmed tokens and the prediction after them
    ahead: list[int]  # predictions for the positions after those


def verify(
    session: Session, lasts: list[int], drafts: list[list[int]], cands: list[list[list[int]]], tail: int
) -> list[Verdict]:
    """One forward of each row's `[last ; drafts ; candidates]` (see `visibility.jacobi_candidates`;
    rows of different lengths padded with slots that see only themselves); per row, commit the
    contender (the chain or a candidate) with the longest confirmed prefix, and the prediction after
    it; keep exactly those entries in the cache. Decided on the host after one read-back of the
    forward's predictions (`session.sampler`'s: a position's draw is the same in every contender).
    `tail`: how many of the last drafts count as the last block when measuring how stationary it is
    (0: not measured)."""
    chains = [1 + len(d) for d in drafts]
    lengths = [tuple(len(c) for c in row) for row in cands]
    totals = [chain + sum(sizes) for chain, sizes in zip(chains, lengths, strict=True)]
    width = max(totals)
    ids, positions, rules = [], [], []
    for row, last, draft, row_cands, chain, sizes, total in zip(
        session.rows, lasts, drafts, cands, chains, lengths, totals, strict=True
    ):
        start = row.origin + row.frontier - 1  # where `last` sits
        offsets = [*range(chain), *(j for length in sizes for j in range(1, length + 1))]
        ids.append([last, *draft, *(t for c in row_cands for t in c)] + [session.model.pad_token_id] * (width - total))
        positions.append([start + o for o in offsets] + [start] * (width - total))
        rules.append((chain, sizes, width - total))
    # A chain alone, or one candidate after the last token alone, is plain causal (and so is padding
    # after it, which no real slot sees): the model's own fast path, no dense mask to build.
    causal = all(not sizes or (chain == 1 and len(sizes) == 1) for chain, sizes in zip(chains, lengths, strict=True))
    rule = None if causal else _candidate_rules(rules, session.device)
    layout = torch.tensor([ids, positions], device=session.device)  # tokens, positions
    logits = session.forward(layout[0], layout[1], rule, read=range(width))
    guesses = session.sampler.sample(logits, layout[1] + 1).tolist()  # each slot's prediction of the next token
    verdicts = [
        _decide(row_ids[:total], guess, chain, sizes, tail)
        for row_ids, guess, chain, sizes, total in zip(ids, guesses, chains, lengths, totals, strict=True)
    ]
    append(session, [v.committed for v in verdicts])
    session.advance(keep=[v.kept for v in verdicts])
    return [v.verdict for v in verdicts]


def _candidate_rules(rows: list[tuple[int, tuple[int, ...], int]], device: torch.device) -> torch.Tensor:
    """The rule of one row's `[last ; chain ; candidates]` ([T, T]), or of each row's, padded [B, T, T]."""
    if len(rows) == 1:
        return visibility.jacobi_candidates(rows[0][0], rows[0][1], device)
    padded = []
    for chain, sizes, padding in rows:
        rule = torch.eye(chain + sum(sizes) + padding, dtype=torch.bool)  # padding sees only itself
        rule[: chain + sum(sizes), : chain + sum(sizes)] = visibility.jacobi_candidates(chain, sizes)
        padded.append(rule)
    return torch.stack(padded).to(device)


@dataclass
class _Decision:
    verdict: Verdict
    committed: list[int]
    kept: list[int]


def _decide(ids: list[int], guesses: list[int], chain: int, lengths: tuple[int, ...], tail: int) -> _Decision:
    """One row's verdict from its layout's tokens and its slots' predictions."""
    # Each contender's token slots, and the slot whose prediction should equal each token.
    token_slots, pred_slots = [list(range(1, chain))], [list(range(chain - 1))]
    begin = chain
    for length in lengths:
        token_slots.append(list(range(begin, begin + length)))
        pred_slots.append([0, *range(begin, begin + length - 1)])
        begin += length
    counts = [
        greedy_prefix([ids[s] for s in slots], [guesses[s] for s in preds])
        for slots, preds in zip(token_slots, pred_slots, strict=True)
    ]
    best = max(range(len(counts)), key=counts.__getitem__)  # the chain wins ties, then the earliest
    accepted = counts[best]
    kept = [0, *token_slots[best][:accepted]]
    committed = [guesses[s] for s in kept]  # the prediction after each kept token
    drafts = ids[1:chain]
    stationary = greedy_prefix(drafts[-tail:], guesses[chain - 1 - tail : chain - 1]) if tail else 0
    # Predictions past the accepted ones seed the next drafts: the winner's, then the chain's.
    ahead = guesses[:chain]
    if best:
        winner = [guesses[s] for s in pred_slots[best]] + [guesses[token_slots[best][-1]]]
        ahead[: len(winner)] = winner
        ahead += winner[len(ahead) :]
    verdict = Verdict(accepted, best, counts[0], stationary, committed, ahead[accepted + 1 :])
    return _Decision(verdict, committed, kept)
