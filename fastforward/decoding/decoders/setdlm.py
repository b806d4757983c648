"""Set Diffusion sliding-window decoding (SW-SetDLM), batched, with an exact cache.

Per row and step: the candidates are the still-masked positions from the row's first masked
position up to `window` positions ahead (never past a revealed stop token or the budget). One
forward reads a mask at each candidate; the row accepts its most confident candidate plus every
candidate whose probability is at least `threshold`, committing them to the canvas at their
positions: each its most probable token, or with a sampler at temperature > 0 one sampled from its
distribution with the position's own draw (`fastforward.decoding.sampling`; which candidates are
accepted is still decided on the model's confidences).

The forward is `[tokens accepted in the previous step ; candidate masks]` at true positions. The
accepted tokens are causal among themselves in position order and see the whole cache; they are
the only entries kept, so the cache grows by exactly what was accepted, in reveal order. A mask
sees the cache, the accepted tokens and itself (`visibility.reveal_order`): the visibility
`objectives.setdlm` trains with, where the tokens of one set are revealed in position order. Rows
carry different numbers of tokens; shorter rows are padded with slots that see only themselves
and are not kept.

`window 1, threshold inf` decodes left to right, one token per forward. The mask token's own
logit is never chosen.

**First token from NTP** (`first_token_from_ntp`, ours): the first masked position takes the clean
stream's next-token prediction, read at the last accepted token in the same forward (after the
prefill, the prefill's), and only the run of candidates right after it at or above `threshold` is
accepted with it. The accepted tokens then always extend a left-to-right prefix, so the cache is a
causal prefill's and that prediction is AR's: with `threshold inf` the output is greedy AR's (or AR
sampling's, with the same draws).

**Infilling** (a `Prompt` with a suffix `gap` positions after the prefix): the window slides over
the gap only. `suffix_cache="promote"` (the default) brings each suffix token into the cache, as a
carried token, in the forward whose window first reaches its position, so masks see the suffix no
earlier than the reveal order of training would show it; `"upfront"` prefills it with the prefix.
Promote is the default because it infilled more accurately on `arithmetic-infill`
(docs/notes/2026-11-28-jacobi-mbd-setdlm-on-the-arithmetic-model.md).
"""

from __future__ import annotations

import math

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import FIRST_TOKEN_FROM_NTP, SAMPLING, Knob, register
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.model import visibility

SUFFIX_CACHE = ("promote", "upfront")


class SetDiffusionDecoder(Decoder):
    """Sliding-window Set Diffusion decoding; see the module docstring."""

    name = "setdlm"
    infills = True
    continuous = True  # per-row windows: rows join and leave between steps (the server batches it so)

    def __init__(
        self,
        window: int = 4,
        threshold: float = 0.9,
        suffix_cache: str = "promote",
        sampler: Sampler | None = None,
        first_token_from_ntp: bool = False,
    ):
        if window < 1:
            raise FastForwardError(f"window must be >= 1, got {window}")
        if not threshold >= 0:
            raise FastForwardError(f"threshold must be >= 0 (inf: one token per forward), got {threshold}")
        if suffix_cache not in SUFFIX_CACHE:
            raise FastForwardError(f"unknown suffix cache {suffix_cache!r}; choose one of {', '.join(SUFFIX_CACHE)}")
        self.window, self.threshold, self.suffix_cache = window, threshold, suffix_cache
        self.sampler = sampler or Sampler()
        self.first_token_from_ntp = first_token_from_ntp

    def open_session(self, model, prompts, max_new_tokens) -> Session:
        upfront = self.suffix_cache == "upfront"
        return Session(model, prompts, max_new_tokens, suffix_upfront=upfront, sampler=self.sampler)

    def begin(self, session: Session, rows: range) -> None:
        """New rows carry nothing yet; an infilling row's suffix waits to be promoted (or is cached)."""
        if self.first_token_from_ntp and any(session.suffixes[row] for row in rows):
            raise FastForwardError(
                "first_token_from_ntp decodes a prefix left to right; infill without it (the suffix is not a prefix)"
            )
        carried, promoted = session.per_row("carried"), session.per_row("promoted")
        for row in rows:
            carried[row] = []  # (position, token) the next forward brings into the cache
            promoted[row] = 0 if session.suffixes[row] and not session.suffix_upfront else -1

    def step(self, session: Session) -> None:
        mask_id = session.model.require_mask_token(self.name)
        ntp = self.first_token_from_ntp
        carried: list[list[tuple[int, int]]] = session.per_row("carried")
        promoted: list[int] = session.per_row("promoted")
        running = [not done for done in session.finished_rows]
        candidates = [self._candidates(session, row) if running[row] else [] for row in range(session.batch)]
        for row in range(session.batch):
            if running[row] and promoted[row] >= 0:
                promoted[row] = self._promote(session, row, promoted[row], carried[row])
        tokens, positions, rule, width = carried_and_masks(session, carried, candidates, mask_id)
        read = range(0 if ntp else width, tokens.shape[1])
        logits = session.forward(tokens, positions, rule, read, rows=torch.tensor(running))
        if ntp:  # the next-token prediction at each row's last accepted token, then the masks'
            first = next_token_logits(session, logits, carried)
            logits = logits[:, width:]
        logits[..., mask_id] = -math.inf
        confidence, choice = torch.softmax(logits, dim=-1).max(dim=-1)
        if session.sampling:  # (greedy rows keep the softmax's own choice, as they always did)
            choice = torch.where(session.sampled_rows()[:, None], session.sample(logits, positions[:, width:]), choice)
        if ntp:
            choice[:, 0] = session.sample(first, positions[:, width])
            confidence[:, 0] = math.inf
        choices, confidences = torch.stack([choice.double(), confidence.double()]).tolist()
        accept = self._accept_run if ntp else self._accept
        accepted = [accept(c, choices[r], confidences[r]) for r, c in enumerate(candidates)]
        commit_writes(session, accepted)
        session.advance(keep=[len(c) for c in carried])
        # what the next forward caches: nothing for a finished row, nothing past a revealed stop token
        for r, row in enumerate(accepted):
            stop = session.first_stops[r]
            carried[r] = [] if session.finished_rows[r] else sorted((p, t) for p, t in row if p <= stop)

    def _promote(self, session: Session, row: int, done: int, carried: list[tuple[int, int]]) -> int:
        """Carry the suffix tokens the window now reaches (they follow the gap); returns how many are in."""
        suffix, gap = session.suffixes[row], session.limits[row]
        reach = session.frontiers[row] + self.window  # positions before this are in the window or behind it
        while done < len(suffix) and gap + done < reach:
            carried.append((gap + done, suffix[done]))
            done += 1
        return done

    def _candidates(self, session: Session, row: int) -> list[int]:
        start = session.frontiers[row]
        end = min(start + self.window, session.limits[row], session.first_stops[row] + 1)
        canvas = session.canvas[row]
        return [p for p in range(start, end) if canvas[p] is None]

    def _accept(self, candidates: list[int], choices: list[float], confidences: list[float]) -> list[tuple[int, int]]:
        """The most confident candidate (the first on a tie) and every one at or above the threshold."""
        if not candidates:
            return []
        conf = confidences[: len(candidates)]
        best = max(range(len(candidates)), key=lambda i: (conf[i], -i))
        return [(p, int(choices[i])) for i, p in enumerate(candidates) if i == best or conf[i] >= self.threshold]

    def _accept_run(
        self, candidates: list[int], choices: list[float], confidences: list[float]
    ) -> list[tuple[int, int]]:
        """The first candidate and the run of consecutive candidates after it at or above the threshold."""
        run: list[tuple[int, int]] = []
        for i, p in enumerate(candidates):
            if run and (p != run[-1][0] + 1 or confidences[i] < self.threshold):
                break
            run.append((p, int(choices[i])))
        return run


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
    for row, (carry, cands) in enumerate(zip(carried, candidates, strict=True)):
        origin = session.origins[row]
        block = [mask_id if t is None else t for t in known[row]] if known is not None else [mask_id] * len(cands)
        ids.append([t for _, t in carry] + [pad_id] * (width - len(carry)) + block + [mask_id] * (reads - len(cands)))
        filler = origin + (carry[-1][0] if carry else session.frontiers[row])
        pos.append([origin + p for p, _ in carry] + [filler] * (width - len(carry)))
        pos[-1] += [origin + p for p in cands] + [filler] * (reads - len(cands))
        clean_rank.append(list(range(len(carry))) + [big + i for i in range(width - len(carry))])
        mask_rank.append([len(carry)] * reads)
    device = session.device
    tokens, positions = torch.tensor(ids, device=device), torch.tensor(pos, device=device)
    if masks_see_masks and all(len(c) == width for c in carried) and all(len(c) == reads for c in candidates):
        return tokens, positions, visibility.sbd_decode(width, reads, device), width
    rule = visibility.reveal_order(torch.tensor(clean_rank), torch.tensor(mask_rank))
    for row, (carry, cands) in enumerate(zip(carried, candidates, strict=True)):
        for slot in range(len(carry), width):  # a padded carried slot sees only itself
            rule[row, slot, :] = False
            rule[row, slot, slot] = True
        if masks_see_masks:
            rule[row, width : width + len(cands), width : width + len(cands)] = True
    return tokens, positions, rule.to(device), width


def next_token_logits(session: Session, logits: torch.Tensor, carried: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[B, V] each row's next-token prediction: from `logits` (read from slot 0 of a
    `carried_and_masks` layout) at its last carried token, or the prefill's when it carries none."""
    last = torch.tensor([len(c) - 1 for c in carried], device=session.device)
    at_last = logits[torch.arange(session.batch, device=session.device), last.clamp_min(0)]
    return torch.where((last >= 0)[:, None], at_last, session.next_logits)


def commit_writes(session: Session, writes: list[list[tuple[int, int]]]) -> None:
    """Each row's (position, token) writes onto the session's canvas."""
    high = max(len(w) for w in writes)
    if not high:
        return
    tokens = [[t for _, t in w] + [0] * (high - len(w)) for w in writes]
    at = [[p for p, _ in w] + [-1] * (high - len(w)) for w in writes]
    session.commit(torch.tensor(tokens), torch.tensor(at))


@register(
    "setdlm",
    knobs=(
        Knob(
            "window",
            int,
            4,
            "setdlm: masked positions decoded at once, from the first masked one",
            check=lambda v: v >= 1,
            rule=">= 1",
        ),
        Knob(
            "threshold",
            float,
            0.9,
            "setdlm: also accept every candidate this probable (inf: only the most confident)",
            check=lambda v: v >= 0,
            rule=">= 0",
        ),
        Knob(
            "suffix_cache",
            str,
            "promote",
            "setdlm infilling: the suffix enters the cache up front or as the window reaches it",
            choices=SUFFIX_CACHE,
        ),
        FIRST_TOKEN_FROM_NTP,
        *SAMPLING,
    ),
    summary="Set Diffusion: a sliding window of masks, confident ones accepted anywhere in it, exact KV cache",
    needs_mask=True,
)
def _build(
    window: int, threshold: float, suffix_cache: str, first_token_from_ntp: bool, sampler: Sampler
) -> SetDiffusionDecoder:
    return SetDiffusionDecoder(window, threshold, suffix_cache, sampler, first_token_from_ntp)
