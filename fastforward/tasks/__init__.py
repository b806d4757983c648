"""Graded tasks for training and evaluation: `get_task("arithmetic")`, `get_task("data/qa.jsonl", match="regex")`.

Built-in tasks: `arithmetic` (GSM8K-style word problems), `pycode` (next line of standard-library
Python), `humaneval` (pass@1 on the 164 HumanEval problems), and the infilling tasks
`arithmetic-infill`, `arithmetic-number-infill` and `pycode-infill` (`fastforward.tasks.infill`). Any
other argument that names a file (or ends in .jsonl) is a JSONL task of {"prompt", "answer"} records.
See `fastforward.tasks.base` for the protocol.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from fastforward.errors import FastForwardError
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
    """The options a task class takes, with their defaults."""
    params = inspect.signature(cls.__init__).parameters
    skip = {"self", "path"} if cls is JsonlTask else {"self"}  # a JSONL task's path is the task's name
    return {name: p.default for name, p in params.items() if name not in skip}


def _coerce(name: str, value: Any, default: Any, task: str) -> Any:
    """Options given as text (from the command line) become the type of their default."""
    if not isinstance(value, str) or default is None or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return type(default)(value)
    except ValueError:
        raise FastForwardError(f"option {name}={value!r} of task {task!r} must be a {type(default).__name__}") from None


def get_task(name_or_path: str, **options: Any) -> Task:
    """A built-in task by name, or a JSONL task for a file path; options go to the task's constructor.

    Option values may be strings (e.g. parsed from `--task-option max_ops=3`): they are converted to
    the type of the option's default. Unknown names and options raise FastForwardError."""
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
    known = task_options(cls)
    unknown = sorted(set(options) - set(known))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in known.items()) or "none"
        raise FastForwardError(f"task {label!r} has no option(s) {unknown}; its options (defaults): {listed}")
    kwargs = {k: _coerce(k, v, known[k], label) for k, v in options.items()}
    return cls(*args, **kwargs)


def parse_options(items: list[str] | None) -> dict[str, str]:
    """["max_ops=3", "match=regex"] → {"max_ops": "3", "match": "regex"} (for a repeated CLI flag)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FastForwardError(f"task option {item!r} must look like name=value, e.g. max_ops=3")
        out[key.strip()] = value.strip()
    return out
