"""Sliding SBD (ours): every forward starts a fresh block where the text so far ends.

An SBD model has two heads on one forward (SBD paper eq. 9): the next-token prediction z_t of the
last known token and the masked predictions ẑ_t..ẑ_{t+k-1} of a block of k masks after it. Here
each forward is `[tokens accepted last step (causal, kept) ; k masks at the next k positions]`
(`visibility`: the masks see the cache, those tokens and each other, as in an SBD block). The token
at the first position is z_t's (AR's choice: the cache is always a causal prefill of the text so
far), and after it the run of masked predictions ẑ_{t+1}, ẑ_{t+2}, ... whose summed entropy stays
within γ (none when the first is already unsure). Those tokens ride along in the next forward and
its block starts right after them. γ = 0 is greedy AR, one token a forward; rows of a batch move
apart freely, and rows join and leave between steps (the server batches it so). With
a sampler at temperature > 0 the first token is sampled from z_t with AR's draw and the run's from
their masked distributions.

Plain `sbd` reveals the block's positions from ẑ alone and keeps the block until it is full; on
the demo's SBD model sliding is far more accurate at the same TPF (docs/results.md, "The lossy rows").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, GAMMA, register, sampling
from fastforward.decoding.policies import entropy
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import carried_and_masks, commit_writes, next_block, next_token_logits
from fastforward.errors import FastForwardError


@dataclass
class SlideState:
    carried: list[tuple[int, int]] = field(default_factory=list)  # the run accepted last step, until cached


@register(
    "sbd-slide",
    summary="Sliding SBD: AR's next token, then the run of sure masked predictions after it; exact KV cache",
    needs_mask=True,
)
@dataclass(eq=False)
class SlidingSBDDecoder(Decoder):
    """A block of `block_size` masks after the text so far, every forward; see the module docstring."""

    block_size: int = BLOCK_SIZE.field()
    gamma: float = GAMMA.field(0.1)
    sampler: Sampler = sampling()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 2:
            raise FastForwardError(
                f"sbd-slide needs a block of at least 2 (a token and a mask after it), got {self.block_size}"
            )

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        """New rows carry nothing yet: their first token is the prefill's next-token prediction."""
        for index in rows:
            session.rows[index].state = SlideState()

    def step(self, session: Session) -> None:
        mask_id = session.model.require_mask_token(self.name)
        states: list[SlideState] = [row.state for row in session.rows]
        carried = [state.carried for state in states]
        blocks = [next_block(row, self.block_size) if not row.finished else [] for row in session.rows]
        tokens, positions, rule, width = carried_and_masks(session, carried, blocks, mask_id, masks_see_masks=True)
        logits = session.forward(tokens, positions, rule, range(tokens.shape[1]))
        first = next_token_logits(session, logits, carried)
        masks = logits[:, width + 1 :]  # the masks after the first position
        sure = (entropy(masks).cumsum(-1) <= self.gamma).cumprod(-1).sum(-1)
        masks[..., mask_id] = -math.inf
        at = positions[:, width:]  # the first position's, then the masks'
        sample = session.sampler.sample
        choice = torch.cat([sample(first[:, None], at[:, :1]), sample(masks, at[:, 1:])], 1)
        stops = [row.stops for row in session.rows]
        runs = zip(blocks, choice.tolist(), sure.tolist(), stops, strict=True)
        accepted = [self._accept(block, choices, run, stop) for block, choices, run, stop in runs]
        commit_writes(session, accepted)
        session.advance(keep=[len(c) for c in carried])
        for row, state, run in zip(session.rows, states, accepted, strict=True):  # what the next forward caches
            state.carried = [] if row.finished else run

    @staticmethod
    def _accept(block: list[int], choices: list[int], run: int, stops: frozenset[int]) -> list[tuple[int, int]]:
        """The first position's token and the sure run after it, cut after a stop token."""
        accepted = []
        for p, token in zip(block[: 1 + run], choices, strict=False):
            accepted.append((p, token))
            if token in stops:
                break
        return accepted
