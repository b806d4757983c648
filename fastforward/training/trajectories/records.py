"""The trajectory record (`Block`, `Trajectory`) and its file: one JSONL line per prompt,

    {"index": 0, "id": "...", "prompt": "...", "correct": true, "prompt_ids": [...], "block_size": 16,
     "init": "repeat", "blocks": [{"states": [[...n ids...], ...], "fixed": [...n ids...]}, ...]}

`states` are a block's iterates y⁽⁰⁾ … y⁽ᵏ⁻¹⁾ before its fixed point, in order (each one's Jacobi
update is the next, y⁽ᵏ⁻¹⁾ ≠ y⁽ᵏ⁾ = fixed); `fixed` is the fixed point. `init` is how the decoder
filled fresh draft slots ("reference": a ground-truth response cut into blocks, no iterates).
`correct` is present when the prompts come from a graded task: the response (up to its first stop
token) graded against the example's reference. A line cut short by a killed run is not a record
(`scan`), so a resumed run writes it again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fastforward.errors import FastForwardError
from fastforward.jsonl import open_jsonl, parse_line

REFERENCE = "reference"  # the `init` of a ground-truth response cut into blocks: no iterates recorded


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


def line(trajectory: Trajectory) -> bytes:
    """A trajectory's line of the file."""
    return (json.dumps(trajectory.to_record(), separators=(",", ":")) + "\n").encode()


def scan(path: Path) -> tuple[list[Trajectory], int]:
    """The complete records of a trajectory file and the byte length they span (a torn tail is excluded)."""
    records: list[Trajectory] = []
    good = 0
    with open_jsonl(path, "trajectory file", "write one with `fastforward trajectories`") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break  # a line cut short by a killed run: ignored, and overwritten on resume
            record = parse_line(raw, path, number)
            if record is not None:
                records.append(Trajectory.from_record(record, f"{path}:{number}"))
            good += len(raw)
    return records, good


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Every complete record of a trajectory file, in prompt order."""
    path = Path(path)
    records, _ = scan(path)
    if not records:
        raise FastForwardError(f"trajectory file {path} has no records")
    return sorted(records, key=lambda t: t.index)
