"""The recipe's data: prompts with or without a worked completion and a final answer, read from JSONL,
split once into train and dev, and sized by a budget; or a built-in task's train split.

Accepted lines (other keys are ignored):

- `{"prompt": ..., "completion": ..., "answer": ...}`: `completion` (the worked response to train on) and
  `answer` (the final answer, for grading) are each optional;
- GSM8K's `{"question": ..., "answer": "...worked solution...\\n#### 72"}`: the question is the prompt,
  the solution (its calculator marks `<<48/2=24>>` removed) the completion, and the number after `####`
  the answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch

from fastforward.errors import FastForwardError
from fastforward.jsonl import read_jsonl
from fastforward.tasks import get_task
from fastforward.training.data import derive_seed

CALCULATOR_MARK = re.compile(r"<<[^<>]*>>")
FINAL_ANSWER = re.compile(r"####\s*(.+?)\s*$")


@dataclass(frozen=True)
class Record:
    """One problem: its prompt, the worked completion to train on (if any) and its final answer (if any)."""

    prompt: str
    completion: str | None = None
    answer: str | None = None


def strip_calculator_marks(solution: str) -> str:
    """A GSM8K solution without its calculator annotations: `48/2 = <<48/2=24>>24` → `48/2 = 24`."""
    return CALCULATOR_MARK.sub("", solution)


def _text(record: dict, key: str, where: str, required: bool = False) -> str | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and key == "answer":
        return json.dumps(value)
    if not isinstance(value, str) or not value.strip():
        raise FastForwardError(f"{where}: {key!r} must be a non-empty string, got {value!r:.60}")
    return value


def parse_record(record: dict, where: str) -> Record:
    """A line of the recipe's data as a `Record` (see the module docstring); bad lines say why."""
    if "question" in record and "prompt" not in record:  # GSM8K
        solution = _text(record, "answer", where, required=True)
        final = FINAL_ANSWER.search(solution.strip())
        if final is None:
            raise FastForwardError(f"{where}: a GSM8K answer must end with '#### <answer>', got {solution[-60:]!r}")
        question = _text(record, "question", where, required=True)
        return Record(question.strip(), strip_calculator_marks(solution).strip(), final.group(1))
    if "prompt" not in record:
        raise FastForwardError(
            f"{where}: expected 'prompt' (with optional 'completion' and 'answer') or GSM8K's 'question' and "
            f"'answer'; got keys {sorted(record)}"
        )
    return Record(
        _text(record, "prompt", where, required=True),
        _text(record, "completion", where),
        _text(record, "answer", where),
    )


def read_records(path: str | Path) -> list[Record]:
    """Every record of a data file, validated."""
    hint = "give a JSONL file of prompt/completion/answer or GSM8K question/answer lines"
    records = [parse_record(r, f"{path}:{n}") for n, r in read_jsonl(Path(path), "data file", hint)]
    if not records:
        raise FastForwardError(f"data file {path} has no records; {hint}")
    return records


def split_dev(records: list[Record], dev: int, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, dev): `dev` records drawn once with `seed`, never trained on; both keep the file's order."""
    if not 0 < dev < len(records):
        raise FastForwardError(
            f"--dev {dev}: hold out at least 1 and fewer than the {len(records)} records of the data for the dev split"
        )
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(derive_seed(seed, "dev")))
    held = set(order[:dev].tolist())
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def write_records(path: Path, records: list[Record]) -> None:
    """Records as JSONL, written to a temporary name and renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps({k: v for k, v in asdict(r).items() if v is not None}) + "\n" for r in records))
    os.replace(tmp, path)


# ---- where the records come from --------------------------------------------------------------------------
@dataclass(frozen=True)
class DataFile:
    """Records read from a JSONL file (`--data FILE`)."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def words(self) -> list[str]:
        """The command-line words that give this data."""
        return ["--data", str(self.path)]

    def records(self) -> list[Record]:
        return read_records(self.path)

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class TaskData:
    """The train split of a built-in task that has worked solutions (`--task arithmetic --problems N
    --task-option K=V`): its problems with their solutions and final answers, made by the task's seeded
    generator, so the same words give the same records on any machine."""

    task: str
    problems: int
    options: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        given = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"the {self.task} task's train split ({self.problems} problems{'; ' + given if given else ''})"

    def words(self) -> list[str]:
        options = [word for k, v in self.options for word in ("--task-option", f"{k}={v}")]
        return ["--task", self.task, *options, "--problems", str(self.problems)]

    def records(self) -> list[Record]:
        return list(self._records)

    @cached_property
    def _records(self) -> tuple[Record, ...]:
        """Made once per instance: the plan checks the checksum and then splits the same records."""
        examples = get_task(self.task, **dict(self.options)).examples("train", n=self.problems, seed=0)
        if not examples or any(e.completion is None for e in examples):
            raise FastForwardError(f"task {self.task!r} has no worked solutions to train on; give --data FILE")
        return tuple(Record(e.prompt, e.completion, e.reference) for e in examples)

    def sha256(self) -> str:
        lines = "".join(json.dumps(asdict(r)) + "\n" for r in self._records)
        return hashlib.sha256(lines.encode()).hexdigest()


# ---- the budget -------------------------------------------------------------------------------------------
_BUDGET = re.compile(r"(?i)^\s*([0-9]*\.?[0-9]+)\s*(k|m|b|min|h)?\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9}


@dataclass(frozen=True)
class Budget:
    """`--budget` read: training tokens, or seconds of training that the recipe converts to tokens at the
    rate it measures on the machine it runs on (training speed differs tenfold between a CPU and a GPU)."""

    tokens: int | None = None
    seconds: float | None = None


def parse_budget(text: str) -> Budget:
    """`--budget`: a token count (`3M`, `500k`, `200000`) or a time (`90min`, `3h`)."""
    match = _BUDGET.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise FastForwardError(
            f"--budget {text!r}: give training tokens (3M, 500k) or a time in minutes or hours (90min, 3h)"
        )
    value, unit = float(match.group(1)), (match.group(2) or "").lower()
    if unit in ("min", "h"):
        return Budget(seconds=value * (60 if unit == "min" else 3600))
    return Budget(tokens=int(value * _SCALE[unit]))
