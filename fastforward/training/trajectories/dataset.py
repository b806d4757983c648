"""Trajectories served for training: fitted to rows of the objective's packing (`fit`), filtered to the
graded-correct ones (`only_correct`; the Jacobi Forcing paper, §4.1, likewise keeps prompts whose
generations pass their unit tests, so the AR term never reinforces a wrong answer), and batched as
`PackedData` batches are (`TrajectoryData`); ground-truth responses as trajectories without iterates
(`from_examples`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fastforward.errors import FastForwardError
from fastforward.training.data import Example, derive_seed, split_examples
from fastforward.training.trajectories.records import REFERENCE, Block, Trajectory, line, read_trajectories


@dataclass
class TrajectoryBatch:
    """Trajectories of one training batch (plain ids: the objective builds the layout on its device);
    `ids`: each example's place in the data stream (default 0..B-1), which seeds its random draws."""

    examples: list[Trajectory]
    ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.ids is None:
            self.ids = list(range(len(self.examples)))

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        return self

    @property
    def n_tokens(self) -> int:
        """Tokens in the packed rows: the prompt plus a noisy and a clean copy of every block."""
        return sum(len(t.prompt_ids) + 2 * len(t.response) for t in self.examples)


def fit(trajectory: Trajectory, seq_len: int) -> Trajectory:
    """The leading blocks that fit `[prompt, noisy₁, clean₁, …]` into seq_len tokens.

    Without room for one block, the prompt keeps only its last tokens.
    """
    n = trajectory.block_size
    if 2 * n + 1 > seq_len:
        raise FastForwardError(
            f"seq_len {seq_len} cannot hold a prompt token and a noisy and a clean block of {n}; "
            f"raise --seq-len to at least {2 * n + 1}"
        )
    prompt = trajectory.prompt_ids
    keep = max(1, min(len(trajectory.blocks), (seq_len - len(prompt)) // (2 * n)))
    if len(prompt) + 2 * n * keep > seq_len:
        prompt = prompt[len(prompt) + 2 * n * keep - seq_len :]
    return replace(trajectory, prompt_ids=prompt, blocks=trajectory.blocks[:keep])


def only_correct(trajectories: Sequence[Trajectory], where: str) -> list[Trajectory]:
    """The trajectories whose response was graded correct; every one must carry a grade."""
    ungraded = sum(t.correct is None for t in trajectories)
    if ungraded:
        raise FastForwardError(
            f"{ungraded} of {len(trajectories)} trajectories in {where} carry no grade: collect them from a "
            "task (`fastforward trajectories --task NAME`) to grade them, or train without --only-correct"
        )
    kept = [t for t in trajectories if t.correct]
    if not kept:
        raise FastForwardError(f"no trajectory in {where} was graded correct: nothing to train on")
    return kept


class TrajectoryData:
    """Trajectories fitted to rows of at most `seq_len` packed tokens, served like `PackedData`.

    The batch for a given index is a pure function of (seed, index): epoch e visits the examples in
    a permutation seeded by (seed, e), so a resumed run sees the same batches.
    """

    def __init__(self, trajectories: Sequence[Trajectory], seq_len: int):
        if not trajectories:
            raise FastForwardError("no trajectories to train on")
        self.seq_len = seq_len
        self.examples = [fit(t, seq_len) for t in trajectories if t.blocks]
        if not self.examples:
            raise FastForwardError("every trajectory is empty (no blocks)")

    @classmethod
    def from_file(cls, path: str | Path, seq_len: int, correct_only: bool = False) -> TrajectoryData:
        trajectories = read_trajectories(path)
        return cls(only_correct(trajectories, str(path)) if correct_only else trajectories, seq_len)

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, index: int, batch_size: int, seed: int) -> TrajectoryBatch:
        n = len(self)
        samples = range(index * batch_size, (index + 1) * batch_size)
        orders = {epoch: self._order(seed, epoch) for epoch in {s // n for s in samples}}
        return TrajectoryBatch([self.examples[int(orders[s // n][s % n])] for s in samples], list(samples))

    def in_order(self, batch_size: int) -> Iterator[TrajectoryBatch]:
        for start in range(0, len(self), batch_size):
            chosen = self.examples[start : start + batch_size]
            yield TrajectoryBatch(chosen, list(range(start, start + len(chosen))))

    def _order(self, seed: int, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))

    def fingerprint(self) -> str:
        """A hash of the fitted trajectories: a resumed run must see the same data."""
        h = hashlib.sha256()
        for t in self.examples:
            h.update(line(t))
        return h.hexdigest()[:16]


def from_examples(examples: Sequence[Example], block_size: int, pad_id: int) -> list[Trajectory]:
    """Ground-truth responses as trajectories without iterates (`init` "reference"): a record's context
    is the prompt, its target tokens the response, cut into blocks of `block_size` (the last one padded
    with `pad_id`, which training cuts off after the stop token). For states that need no rollout
    (the jacobi_forcing objective's "random-tail")."""
    if block_size < 1:
        raise FastForwardError(f"the block size must be at least 1, got {block_size}")
    out = []
    for index, example in enumerate(examples):
        start = next((i for i, target in enumerate(example.targets) if target), len(example.ids))
        prompt, response = example.ids[:start], example.ids[start:]
        if not prompt or not response:
            raise FastForwardError(f"example {index} needs a prompt and a completion to train Jacobi Forcing on")
        response = response + [pad_id] * (-len(response) % block_size)
        blocks = [Block([], response[i : i + block_size]) for i in range(0, len(response), block_size)]
        out.append(Trajectory(prompt, blocks, block_size, index=index, init=REFERENCE))
    return out


def trajectory_datasets(
    path: str | Path | None,
    seq_len: int,
    eval_path: str | Path | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    correct_only: bool = False,
) -> tuple[TrajectoryData, TrajectoryData | None]:
    """Training data (and held-out data: a second file, or a seeded share of the first) from trajectory
    files; correct_only keeps the trajectories graded correct."""
    if not path:
        raise FastForwardError(
            "the jacobi_forcing objective trains on Jacobi trajectories: give --trajectories FILE "
            "(write one with `fastforward trajectories`)"
        )
    records = read_trajectories(path)
    held = read_trajectories(eval_path) if eval_path else None
    if correct_only:
        records = only_correct(records, str(path))
        held = only_correct(held, str(eval_path)) if held else None
    if held is None and eval_fraction:
        records, held = split_examples(records, eval_fraction, seed)  # type: ignore[arg-type]
    return TrajectoryData(records, seq_len), TrajectoryData(held, seq_len) if held else None
