"""The task protocol: examples with a prompt and a reference, and a grader for a model's output text.

A task hands out `Example`s for a split and grades the text a model produced for one. Tasks work on
text only (no tokenizer, no torch), so the same task serves any model and any decoder:

    task = get_task("arithmetic", max_ops=3)
    for ex in task.examples("test", n=200, seed=0):
        output = decode(ex.prompt)           # the model's continuation, without the prompt
        grade = task.grade(ex, output)       # Grade(correct, score, detail)

`max_new_tokens` and `stop` are hints for the caller: a generation budget that fits the task's
answers, and text after which the answer is complete (generation may stop there; grading never needs
it, each grader cuts the output itself).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastforward.errors import FastForwardError
from fastforward.options import check_options


@dataclass(frozen=True)
class Example:
    """One graded item.

    `prompt`: the text sent to the model. `reference`: what the grader compares against (the final
    number, the next line(s), the test code, the answer). `completion`: a target completion for
    training when the task has one (a worked solution, the canonical code), else None. `meta`:
    anything else the grader needs (e.g. HumanEval's entry point).
    """

    id: str
    prompt: str
    reference: str
    completion: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Grade:
    """`correct`: the output counts as right; `score` in [0, 1] (1.0/0.0 for pass/fail graders);
    `detail`: a short human-readable reason (what was parsed, why it failed)."""

    correct: bool
    score: float
    detail: str = ""


class Task:
    """Base class of the built-in tasks; subclasses set `name`, `splits` and implement the two methods.
    The built-in tasks are dataclasses whose option fields (`fastforward.options`) are their options,
    given as `get_task(name, **options)` and `--task-option NAME=VALUE`."""

    name: str = "task"
    splits: tuple[str, ...] = ("train", "test")
    default_size: int = 200  # examples returned when n is None, for tasks that can make any number
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    infilling: bool = False  # examples carry meta["suffix"]: decode the reference between prompt and suffix

    def __post_init__(self) -> None:
        """Refuse option values outside their bounds, however the task is made (`get_task`, Python); a
        task with rules between its options checks them after these."""
        check_options(self)

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        raise NotImplementedError

    def grade(self, example: Example, output: str) -> Grade:
        raise NotImplementedError

    def grade_all(self, examples: Sequence[Example], outputs: Sequence[str]) -> list[Grade]:
        """Grade many outputs (in order); tasks with slow graders run them in parallel."""
        if len(examples) != len(outputs):
            raise FastForwardError(f"got {len(outputs)} outputs for {len(examples)} examples; give one output each")
        return [self.grade(e, o) for e, o in zip(examples, outputs, strict=True)]

    def training_records(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """{"prompt", "completion"} records from the train split, for `fastforward train`."""
        raise FastForwardError(
            f"task {self.name!r} has no training data; use a JSONL file of prompt/completion records"
        )

    def describe(self) -> dict[str, Any]:
        """The task's name and options: enough to rebuild it, for result files."""
        return {"name": self.name}

    # ---- helpers for subclasses ---------------------------------------------------------------------
    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise FastForwardError(
                f"task {self.name!r} has no split {split!r}; its splits are: {', '.join(self.splits)}"
            )

    def _size(self, n: int | None, default: int | None) -> int | None:
        """`n` checked, or `default` when n is None."""
        if n is None:
            return default
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise FastForwardError(f"the number of examples must be a non-negative integer, got {n!r}")
        return n


def stable_hash(text: str) -> float:
    """A number in [0, 1) from `text`, the same on every machine and run (used to assign splits)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def seeded_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded from several parts (task, split, seed): independent, reproducible streams."""
    return random.Random(repr(parts))
