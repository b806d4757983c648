"""Jacobi trajectories: a run of the registered `jacobi` decoder, with the iterates of each block recorded.

The response is cut into blocks of n positions, n being the decoder's block size. The decoder
(`fastforward.decoding.decoders.jacobi`) keeps n drafts after each row's committed text and commits
the prefix its forward confirms. While a row's frontier lies in block b, its drafts cover the rest
of the block, so the block's state is its committed head followed by those drafts. The forward
computes that state's Jacobi update (Jacobi Forcing paper §2.1, eq. 3: position i takes the greedy
token after the context and the state's tokens before i), which is the block's next state, until
the block's last position is committed: its fixed point, greedy AR decoding's tokens. A block's
trajectory is therefore the states its row passes through, read between the decoder's steps: from
the drafts it holds when its frontier enters the block (fresh slots filled as `draft_init` says,
the others the predictions past what the last forward confirmed) to the fixed point. Nothing is
decoded for the record, so the trajectory is the decoder's own, drafts and keys included: "random"
drafts are keyed by the row's seed, prompt and slot position (`sampling.random_tokens`), and a
prompt's trajectory does not depend on its batch.

Rows decode through stop tokens (a record holds whole blocks) and end after the block whose fixed
point holds the first one, or after ⌈max_new_tokens / n⌉ blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from fastforward.api import build_decoder
from fastforward.decoding.decoders.jacobi import JacobiDecoder, JacobiState
from fastforward.decoding.runtime import Prompt, Row, Status
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.training.trajectories.records import Block


def jacobi_decoder(block_size: int, init: str = "repeat", seed: int = 0) -> JacobiDecoder:
    """The registered `jacobi` decoder, greedy, that collection runs; `seed` keys its random drafts."""
    return cast(JacobiDecoder, build_decoder("jacobi", block_size=block_size, draft_init=init, seed=seed))


@dataclass
class Rollout:
    """A prompt's blocks, and the decoder's forwards that made them."""

    blocks: list[Block]
    forwards: int


def block_count(model: Model, prompts: Sequence[Sequence[int]], block_size: int, max_new_tokens: int) -> int:
    """Blocks to decode: ⌈max_new_tokens / n⌉, fewer where the model's context has no room for them."""
    if max_new_tokens <= 0:
        raise FastForwardError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    blocks = math.ceil(max_new_tokens / block_size)
    if model.max_context is not None:
        room = (model.max_context - max(len(p) for p in prompts)) // block_size
        if room < 1:
            raise FastForwardError(
                f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room for a block of {block_size} "
                f"in the model's context of {model.max_context}; shorten it or lower --block-size"
            )
        blocks = min(blocks, room)
    return blocks


@dataclass
class _Recording:
    """One row's finished blocks, and the states so far of the block its frontier is in."""

    blocks: list[Block] = field(default_factory=list)
    states: list[list[int]] = field(default_factory=list)

    def see(self, row: Row, n: int, stops: frozenset[int]) -> None:
        """Between steps: close the blocks the last step completed, ending the row after the first that
        holds a stop token (it decodes through them: its own stops are off), then note the state of the
        block its frontier is in."""
        while row.status is not Status.STOP and (len(self.blocks) + 1) * n <= row.frontier:
            start = len(self.blocks) * n
            fixed = cast(list[int], row.canvas[start : start + n])
            if self.states and self.states[-1] == fixed:
                self.states.pop()  # its drafts were right already: the fixed point, not an iterate before it
            self.blocks.append(Block(self.states, fixed))
            self.states = []
            if not stops.isdisjoint(fixed):
                row.finish(Status.STOP)
        if not row.finished:
            start = len(self.blocks) * n
            drafts = cast(JacobiState, row.state).drafts  # the n tokens from the frontier on
            self.states.append(cast(list[int], row.canvas[start : row.frontier]) + drafts[: start + n - row.frontier])


@torch.inference_mode()
def rollouts(
    model: Model, decoder: JacobiDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[Rollout]:
    """Decode a batch of prompts with `decoder` (`jacobi_decoder`), recording per prompt the trajectory
    of every block of its response (see the module docstring). The session bounds no step's tokens
    (`Session.step_tokens`), so a row's drafts between steps are the n its next forward feeds."""
    n = decoder.block_size
    budget = block_count(model, prompts, n, max_new_tokens) * n
    session = decoder.open_session(model, [Prompt(list(p), ignore_eos=True) for p in prompts], budget)
    decoder.begin(session, range(session.batch))
    recordings = [_Recording() for _ in prompts]
    stops = frozenset(model.stop_token_ids)
    while True:
        for row, recording in zip(session.rows, recordings, strict=True):
            recording.see(row, n, stops)
        if session.finished:
            return [Rollout(r.blocks, row.forwards) for r, row in zip(recordings, session.rows, strict=True)]
        decoder.step(session)
