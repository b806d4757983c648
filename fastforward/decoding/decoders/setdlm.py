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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import FIRST_TOKEN_FROM_NTP, register, sampling
from fastforward.decoding.policies import most_confident
from fastforward.decoding.runtime import Row, Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import carried_and_masks, commit_writes, next_token_logits
from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, NON_NEGATIVE, option

SUFFIX_CACHE = ("promote", "upfront")


@dataclass
class SetDLMState:
    promoted: int  # suffix tokens brought into the cache so far (-1: none to bring, or cached up front)
    carried: list[tuple[int, int]] = field(default_factory=list)  # (position, token) the next forward caches


@register(
    "setdlm",
    summary="Set Diffusion: a sliding window of masks, confident ones accepted anywhere in it, exact KV cache",
    needs_mask=True,
)
@dataclass(eq=False)
class SetDiffusionDecoder(Decoder):
    """Sliding-window Set Diffusion decoding; see the module docstring."""

    infills = True

    window: int = option(4, "setdlm: masked positions decoded at once, from the first masked one", AT_LEAST_ONE)
    threshold: float = option(
        0.9, "setdlm: also accept every candidate this probable (inf: only the most confident)", NON_NEGATIVE
    )
    suffix_cache: str = option(
        "promote",
        "setdlm infilling: the suffix enters the cache up front or as the window reaches it",
        choices=SUFFIX_CACHE,
    )
    sampler: Sampler = sampling()
    first_token_from_ntp: bool = FIRST_TOKEN_FROM_NTP.field()

    @property
    def causal_cache(self) -> bool:
        """Tokens enter the cache in reveal order, unless every step starts from the NTP prediction."""
        return self.first_token_from_ntp

    @property
    def suffix_upfront(self) -> bool:
        return self.suffix_cache == "upfront"

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        """New rows carry nothing yet; an infilling row's suffix waits to be promoted (or is cached)."""
        if self.first_token_from_ntp and any(session.rows[index].suffix for index in rows):
            raise FastForwardError(
                "first_token_from_ntp decodes a prefix left to right; infill without it (the suffix is not a prefix)"
            )
        for index in rows:
            row = session.rows[index]
            row.state = SetDLMState(0 if row.suffix and not self.suffix_upfront else -1)

    def step(self, session: Session) -> None:
        mask_id = session.model.require_mask_token(self.name)
        ntp = self.first_token_from_ntp
        states: list[SetDLMState] = [row.state for row in session.rows]
        candidates = [self._candidates(row) if not row.finished else [] for row in session.rows]
        for row, state in zip(session.rows, states, strict=True):
            if not row.finished and state.promoted >= 0:
                state.promoted = self._promote(row, state)
        carried = [state.carried for state in states]
        tokens, positions, rule, width = carried_and_masks(session, carried, candidates, mask_id)
        read = range(0 if ntp else width, tokens.shape[1])
        logits = session.forward(tokens, positions, rule, read)
        if ntp:  # the next-token prediction at each row's last accepted token, then the masks'
            first = next_token_logits(session, logits, carried)
            logits = logits[:, width:]
        logits[..., mask_id] = -math.inf
        confidence = torch.softmax(logits, dim=-1).amax(dim=-1)
        choice = session.sampler.sample(logits, positions[:, width:])
        if ntp:
            choice[:, 0] = session.sampler.sample(first, positions[:, width])
            confidence[:, 0] = math.inf
        choices, confidences = torch.stack([choice.double(), confidence.double()]).tolist()
        accept = self._accept_run if ntp else self._accept
        accepted = [accept(c, choices[r], confidences[r]) for r, c in enumerate(candidates)]
        commit_writes(session, accepted)
        session.advance(keep=[len(c) for c in carried])
        # what the next forward caches: nothing for a finished row, nothing past a revealed stop token
        for row, state, writes in zip(session.rows, states, accepted, strict=True):
            state.carried = [] if row.finished else sorted((p, t) for p, t in writes if p <= row.first_stop)

    def _promote(self, row: Row, state: SetDLMState) -> int:
        """Carry the suffix tokens the window now reaches (they follow the gap); returns how many are in."""
        done, suffix, gap = state.promoted, row.suffix, row.limit
        reach = row.frontier + self.window  # positions before this are in the window or behind it
        while done < len(suffix) and gap + done < reach:
            state.carried.append((gap + done, suffix[done]))
            done += 1
        return done

    def _candidates(self, row: Row) -> list[int]:
        start = row.frontier
        end = min(start + self.window, row.limit, row.first_stop + 1)
        return [p for p in range(start, end) if row.canvas[p] is None]

    def _accept(self, candidates: list[int], choices: list[float], confidences: list[float]) -> list[tuple[int, int]]:
        """The most confident candidate (the first on a tie) and every one at or above the threshold."""
        if not candidates:
            return []
        best = most_confident(confidences, range(len(candidates)))
        return [(p, int(choices[i])) for i, p in enumerate(candidates) if i == best or confidences[i] >= self.threshold]

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
