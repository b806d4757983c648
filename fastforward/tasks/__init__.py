"""Graded tasks for training and evaluation: `get_task("arithmetic")`, `get_task("data/qa.jsonl", match="regex")`.

Built-in tasks: `arithmetic` (GSM8K-style word problems), `pycode` (next line of standard-library
Python), `humaneval` (pass@1 on the 164 HumanEval problems), and the infilling tasks
`arithmetic-infill`, `arithmetic-number-infill` and `pycode-infill` (`fastforward.tasks.infill`). Any
other argument that names a file (or ends in .jsonl) is a JSONL task of {"prompt", "answer"} records.
See `fastforward.tasks.base` for the protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastforward.errors import FastForwardError
from fastforward.options import Knob, options_of
from fastforward.tasks.arithmetic import ArithmeticTask
from fastforward.tasks.base import Example, Grade, Task
from fastforward.tasks.humaneval import HumanEvalTask
from fastforward.tasks.infill import ArithmeticInfillTask, ArithmeticNumberInfillTask, PyCodeInfillTask
from fastforward.tasks.jsonl import JsonlTask
from fastforward.tasks.pycode import PyCodeTask

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "pycode": PyCodeTask,
    "humaneval": HumanEvalTask,
    "arithmetic-infill": ArithmeticInfillTask,
    "arithmetic-number-infill": ArithmeticNumberInfillTask,
    "pycode-infill": PyCodeInfillTask,
}

__all__ = [
    "TASKS",
    "ArithmeticInfillTask",
    "ArithmeticTask",
    "Example",
    "Grade",
    "HumanEvalTask",
    "JsonlTask",
    "PyCodeInfillTask",
    "PyCodeTask",
    "Task",
    "get_task",
    "parse_options",
    "task_options",
]


def task_options(cls: type[Task]) -> dict[str, Any]:
    """The options a task class takes, with their defaults (a JSONL task's path is no option: the task's name)."""
    return {name: knob.default for name, knob in options_of(cls).items()}


def get_task(name_or_path: str, **options: Any) -> Task:
    """A built-in task by name, or a JSONL task for a file path; options go to the task's constructor.

    Option values may be strings (e.g. parsed from `--task-option max_ops=3`): they are read as the
    option's type. Unknown names and options and values outside an option's bounds raise FastForwardError,
    naming the option as `task option NAME`."""
    if name_or_path in TASKS:
        cls: type[Task] = TASKS[name_or_path]
        label = name_or_path
        args: list[Any] = []
    elif name_or_path.endswith((".jsonl", ".json", ".gz")) or Path(name_or_path).exists():
        cls, label, args = JsonlTask, "jsonl", [name_or_path]
    else:
        raise FastForwardError(
            f"unknown task {name_or_path!r}; choose one of: {', '.join(TASKS)}, "
            'or give the path of a JSONL file of {"prompt", "answer"} lines'
        )
    known = options_of(cls)
    unknown = sorted(set(options) - set(known))
    if unknown:
        listed = ", ".join(f"{k}={v.default!r}" for k, v in known.items()) or "none"
        raise FastForwardError(f"task {label!r} has no option(s) {unknown}; its options (defaults): {listed}")
    kwargs = {k: read(known[k], v, f"task option {k}") for k, v in options.items()}
    return cls(*args, **kwargs)


def read(knob: Knob, value: Any, label: str) -> Any:
    """A task option's value, checked: text (from the command line) is read as the option's type."""
    return knob.parse(value, label) if isinstance(value, str) else knob.validate(value, label)


def parse_options(items: list[str] | None) -> dict[str, str]:
    """["max_ops=3", "match=regex"] → {"max_ops": "3", "match": "regex"} (for a repeated CLI flag)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FastForwardError(f"task option {item!r} must look like name=value, e.g. max_ops=3")
        out[key.strip()] = value.strip()
    return out
