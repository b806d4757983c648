"""Jacobi trajectories: fixed-span Jacobi decoding that records every iterate of every block.

Fixed-span Jacobi decoding (Jacobi Forcing paper §2.1, eq. 3-4): the response is cut into blocks of
n positions. A block starts from a draft y⁽⁰⁾ (the initialisation is a knob) and is refined by
causal forwards of the block's current state after the committed context: y⁽ʲ⁺¹⁾₁ is the greedy
token after the context and y⁽ʲ⁺¹⁾ᵢ the greedy token after y⁽ʲ⁾₍<ᵢ₎. When a forward returns the
state it was given, the state is the block's fixed point (equal to greedy AR decoding) and its
cache entries — computed from exactly those tokens, causally — are kept; every other forward keeps
nothing. Collection stops after the block whose fixed point holds a stop token, or after
⌈max_new_tokens / n⌉ blocks: whole blocks are always decoded.

The records (`Block`, `Trajectory`) are what `fastforward.training.trajectories` stores as
JSONL and serves to Jacobi Forcing training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastforward.decoding.policies import greedy_prefix
from fastforward.decoding.runtime import start
from fastforward.decoding.sampling import greedy
from fastforward.decoding.steps import append, span
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.training.data import derive_seed

DRAFT_INITS = ("repeat", "random", "pad")
REFERENCE = "reference"  # the `init` of a ground-truth response cut into blocks: no iterates recorded


# ---- the stored form ----------------------------------------------------------------------------
@dataclass
class Block:
    """One block's Jacobi trajectory: the iterates before the fixed point, and the fixed point."""

    states: list[list[int]]
    fixed: list[int]

    @property
    def trajectory(self) -> list[list[int]]:
        """Every point of the trajectory, ending at the fixed point."""
        return [*self.states, self.fixed]

    def unconverged(self, state: Sequence[int]) -> float:
        """Fraction of the block's tokens where `state` differs from the fixed point."""
        return sum(a != b for a, b in zip(state, self.fixed, strict=True)) / len(self.fixed)


@dataclass
class Trajectory:
    """A prompt's ids and the Jacobi trajectory of each block of its response."""

    prompt_ids: list[int]
    blocks: list[Block]
    block_size: int
    index: int = 0
    init: str = "repeat"
    prompt: str | None = None
    id: str | None = None
    correct: bool | None = None  # graded against the task's reference (None: not graded)

    @property
    def response(self) -> list[int]:
        """The fixed points concatenated: greedy AR decoding's output, whole blocks (past any stop token)."""
        return [t for b in self.blocks for t in b.fixed]

    def answer(self, stop_ids: Sequence[int]) -> list[int]:
        """The response up to and including its first stop token: what greedy AR decoding returns."""
        response, stops = self.response, set(stop_ids)
        return response[: next((i + 1 for i, t in enumerate(response) if t in stops), len(response))]

    @property
    def forwards(self) -> int:
        """Jacobi forwards spent: one per point of every block's trajectory."""
        return sum(len(b.states) + 1 for b in self.blocks)

    def to_record(self) -> dict:
        record: dict = {"index": self.index}
        if self.id is not None:
            record["id"] = self.id
        if self.prompt is not None:
            record["prompt"] = self.prompt
        if self.correct is not None:
            record["correct"] = self.correct
        record.update(
            prompt_ids=self.prompt_ids,
            block_size=self.block_size,
            init=self.init,
            blocks=[{"states": b.states, "fixed": b.fixed} for b in self.blocks],
        )
        return record

    @classmethod
    def from_record(cls, record: dict, where: str = "record") -> Trajectory:
        try:
            n = int(record["block_size"])
            blocks = [
                Block([list(map(int, s)) for s in b["states"]], list(map(int, b["fixed"]))) for b in record["blocks"]
            ]
            traj = cls(
                prompt_ids=list(map(int, record["prompt_ids"])),
                blocks=blocks,
                block_size=n,
                index=int(record["index"]),
                init=str(record.get("init", "repeat")),
                prompt=record.get("prompt"),
                id=record.get("id"),
                correct=record.get("correct"),
            )
            if traj.correct is not None and not isinstance(traj.correct, bool):
                raise ValueError(f"correct must be true or false, got {traj.correct!r}")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise FastForwardError(f"{where}: not a trajectory record ({type(exc).__name__}: {exc})") from exc
        if any(len(s) != n for b in blocks for s in b.trajectory):
            raise FastForwardError(f"{where}: a block state does not have block_size={n} tokens")
        return traj


def _drafts(init: str, before: torch.Tensor, n: int, model: Model, seeds: list[int]) -> torch.Tensor:
    """Initial states [B, n] of fresh blocks; `before` is the token preceding each block."""
    if init == "repeat":
        return before[:, None].expand(-1, n).clone()
    if init == "pad":
        return torch.full((len(before), n), model.pad_token_id, dtype=torch.long, device=before.device)
    vocab = model.vocab_size
    rows = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(s)) for s in seeds]
    return torch.stack(rows).to(before.device)


def block_count(model: Model, prompts: Sequence[Sequence[int]], block_size: int, max_new_tokens: int) -> int:
    """Blocks to decode: ⌈max_new_tokens / n⌉, fewer where the model's context has no room for them."""
    if block_size <= 0:
        raise FastForwardError(f"block size must be > 0, got {block_size}")
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


@torch.inference_mode()
def jacobi_trajectories(
    model: Model,
    prompts: Sequence[Sequence[int]],
    block_size: int = 16,
    max_new_tokens: int = 256,
    init: str = "repeat",
    seed: int = 0,
    keys: Sequence[int] | None = None,
) -> list[list[Block]]:
    """Fixed-span Jacobi decoding of a batch of prompts; per prompt, the trajectory of every block.

    `keys` (default 0..B-1) name the prompts for the random initialisation, so a prompt's drafts do
    not depend on the batch it is decoded in. Rows advance through their blocks independently; a
    row whose block has not converged keeps no cache entries (a hole the other rows never see). A
    row stops after the block holding its first stop token, or after the last block.
    """
    if init not in DRAFT_INITS:
        raise FastForwardError(f"unknown draft init {init!r}; choose one of {', '.join(DRAFT_INITS)}")
    n = block_size
    wanted = block_count(model, prompts, n, max_new_tokens)
    keys = list(range(len(prompts))) if keys is None else list(keys)
    session = start(model, [list(p) for p in prompts], wanted * n)
    device = session.device
    batch = session.batch
    following = greedy(session.next_logits)  # greedy token after each row's committed context
    before = torch.tensor([p[-1] for p in prompts], device=device)
    blocks: list[list[Block]] = [[] for _ in range(batch)]
    pending: list[list[list[int]]] = [[] for _ in range(batch)]

    def fresh(rows: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """`state` with the rows that start a new block replaced by their initial drafts."""
        if not bool(rows.any()):
            return state
        seeds = [derive_seed(seed, keys[r], len(blocks[r])) for r in range(batch)]
        return torch.where(rows[:, None], _drafts(init, before, n, model, seeds), state)

    state = fresh(
        torch.ones(batch, dtype=torch.bool, device=device), torch.zeros(batch, n, dtype=torch.long, device=device)
    )
    steps = torch.arange(n, device=device)
    while not session.finished:
        active = [not row.finished for row in session.rows]
        running = torch.tensor(active, device=device)
        logits = session.forward(state, span(session, 0, n), read=steps)
        guess = greedy(logits)
        update = torch.cat([following[:, None], guess[:, :-1]], dim=1)
        converged = (greedy_prefix(state, update) == n) & running
        rows, states = converged.tolist(), state.tolist()
        append(session, states, [n * c for c in rows])  # a fixed point is greedy AR's output
        session.advance(keep=[n * c for c in rows])
        for r in range(batch):
            if not active[r]:
                continue
            if rows[r]:
                blocks[r].append(Block(pending[r], states[r]))
                pending[r] = []
            else:
                pending[r].append(states[r])
        following = torch.where(converged, guess[:, -1], following)
        before = torch.where(converged, state[:, -1], before)
        state = fresh(converged, update)
    return blocks
