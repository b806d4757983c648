"""Where the prompts of a collection come from (`PromptSource`): a JSONL file of prompts (`read_prompts`)
or a task's examples with its grader and budget (`task_prompts`); and how they are collected
(`Collection`, `collect_from`: `writer.collect` over a source).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastforward.errors import FastForwardError
from fastforward.jsonl import read_jsonl
from fastforward.model import Model
from fastforward.training.data import encode_record
from fastforward.training.trajectories.dataset import from_examples
from fastforward.training.trajectories.records import Trajectory
from fastforward.training.trajectories.writer import CollectSummary, collect


def read_prompts(path: str | Path) -> tuple[list[str], list[str], list[str] | None]:
    """Prompts, ids and completions of a JSONL file of {"prompt": ..., ...} records ("id" is kept, else the
    count so far; the completions are None unless every record has a non-empty string "completion"; other
    keys are ignored)."""
    prompts, ids, completions = [], [], []
    for number, record in read_jsonl(path, "prompt file", 'give a JSONL file of {"prompt": ...} lines'):
        if not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise FastForwardError(f'{path}:{number}: expected an object with a non-empty string "prompt"')
        prompts.append(record["prompt"])
        ids.append(str(record.get("id", len(ids))))
        completions.append(record.get("completion"))
    complete = all(isinstance(c, str) and c for c in completions)
    return prompts, ids, completions if complete else None


@dataclass
class PromptSource:
    """Prompts to collect trajectories for, and their ids; from a task, also its budget and grader."""

    prompts: list[str]
    ids: list[str]
    completions: list[str] | None = None  # reference responses (a task's worked solutions), where known
    max_new_tokens: int | None = None
    grade: Callable[[int, str], bool] | None = None  # (prompt index, response text) → correct

    def references(self, tokenizer, block_size: int, pad_id: int, chat_template: bool = True) -> list[Trajectory]:
        """The reference responses as trajectories without iterates (`from_examples`)."""
        if self.completions is None:
            raise FastForwardError(
                "training on reference responses needs them: a --task whose examples have worked solutions, "
                'or a --prompts file whose every line has a "completion"'
            )
        records = [{"prompt": p, "completion": c} for p, c in zip(self.prompts, self.completions, strict=True)]
        return from_examples([encode_record(r, tokenizer, chat_template) for r in records], block_size, pad_id)


def task_prompts(
    task: str, n: int | None = None, split: str = "train", seed: int = 0, options: dict | None = None
) -> PromptSource:
    """The prompts of a task's examples (e.g. arithmetic's train split), with the task's grader."""
    from fastforward.tasks import get_task

    chosen = get_task(task, **(options or {}))
    examples = chosen.examples(split, n, seed)
    if not examples:
        raise FastForwardError(f"task {task!r} gave no {split} examples")

    def grade(index: int, text: str) -> bool:
        return chosen.grade(examples[index], text).correct

    completions = [e.completion for e in examples]
    known = completions if all(c is not None for c in completions) else None
    return PromptSource([e.prompt for e in examples], [e.id for e in examples], known, chosen.max_new_tokens, grade)


@dataclass(frozen=True)
class Collection:
    """How trajectories are collected from a `PromptSource` (the settings of `collect`)."""

    max_new_tokens: int | None = None  # None: the source's budget, else 256 (rounded up to whole blocks)
    init: str = "repeat"
    batch_size: int = 8
    seed: int = 0
    chat_template: bool = True


def collect_from(
    model: Model,
    source: PromptSource,
    collection: Collection,
    path: str | Path,
    block_size: int,
    shard: tuple[int, int] = (0, 1),
) -> CollectSummary:
    """`collect` over the prompts of `source` (those of `shard`), with their ids and grader."""
    return collect(
        model,
        source.prompts,
        path,
        block_size=block_size,
        max_new_tokens=collection.max_new_tokens or source.max_new_tokens or 256,
        init=collection.init,
        batch_size=collection.batch_size,
        seed=collection.seed,
        chat_template=collection.chat_template,
        ids=source.ids,
        grade=source.grade,
        shard=shard,
        progress=shard[0] == 0,
    )
