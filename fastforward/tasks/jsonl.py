"""A task from any JSONL file of {"prompt", "answer"} records (an optional "id" is kept; other keys ignored).

`match` decides how an output is graded against the record's answer:

- "exact" (default): the output, stripped of surrounding whitespace, equals the answer stripped;
- "contains": the stripped answer occurs somewhere in the output;
- "regex": the answer is a regular expression, searched for (`re.search`) in the stripped output;
  anchor it with `^…$` to demand the whole output.

`extract` picks the answer out of the output before comparing, as lm-evaluation-harness filters do:

- "none" (default): the whole output;
- "final": the number after the last `####` (the GSM8K convention, and the arithmetic task's);
- "last-number": the last number in the output;
- any other text: a regular expression with a capture group; the last match's first group is taken.

Under "exact", an extracted answer and the record's answer that both read as numbers are compared
as numbers: `41`, `41.0`, `+41` and `$41` are equal, and `41,000` equals `41000`. An output with
nothing to extract is graded wrong ("malformed").

A number as the answer is read as its JSON text ("answer": 42 → "42"). Bad lines raise
FastForwardError with the file and line number. The file is one test split; `n` takes the first n
records (the seed is ignored).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from fastforward.errors import FastForwardError
from fastforward.jsonl import read_jsonl
from fastforward.options import option
from fastforward.tasks.base import Example, Grade, Task

MATCHES = ("exact", "contains", "regex")
_NUMBER = r"[-+]?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
EXTRACTORS = {"final": rf"####\s*({_NUMBER})", "last-number": rf"({_NUMBER})"}


def as_number(text: str) -> Decimal | None:
    """`text` as a number if it is one (sign, `$`, thousands commas and a trailing full stop allowed)."""
    text = text.strip().rstrip(".")
    if not re.fullmatch(_NUMBER, text):
        return None
    try:
        return Decimal(text.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None


def extractor(extract: str) -> re.Pattern | None:
    """The compiled pattern of an `extract` option (None for "none"); a custom one needs a group."""
    if extract == "none":
        return None
    pattern = EXTRACTORS.get(extract, extract)
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise FastForwardError(f"extract={extract!r} is not a valid regular expression ({exc})") from exc
    if compiled.groups < 1:
        raise FastForwardError(
            f"extract={extract!r} has no capture group; wrap the answer part in parentheses, e.g. 'answer: (\\S+)', "
            f"or use one of: none, {', '.join(EXTRACTORS)}"
        )
    return compiled


@dataclass(eq=False)
class JsonlTask(Task):
    """Prompt/answer pairs from a JSONL file; see the module docstring."""

    splits = ("test",)
    max_new_tokens = 256

    path: str | Path  # the file, which names the task (no option: kept as its Path)
    match: str = option("exact", "how an output is compared with the answer", choices=MATCHES)
    extract: str = option("none", f"what is taken from the output: none, {', '.join(EXTRACTORS)} or a regex")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.path = Path(self.path)
        self._extractor = extractor(self.extract)
        self.name = self.path.stem
        self.records = self._read()

    def describe(self) -> dict:
        return {"name": "jsonl", "path": str(self.path), "match": self.match, "extract": self.extract}

    def _read(self) -> list[Example]:
        lines = read_jsonl(self.path, "task file", "give a JSONL file of prompt/answer lines")
        return [self._parse(record, f"{self.path}:{number}", number) for number, record in lines]

    def _parse(self, record: dict, where: str, number: int) -> Example:
        if "prompt" not in record or "answer" not in record:
            raise FastForwardError(f'{where}: expected an object with keys "prompt" and "answer", got {sorted(record)}')
        prompt, answer = record["prompt"], record["answer"]
        if not isinstance(prompt, str) or not prompt:
            raise FastForwardError(f'{where}: "prompt" must be a non-empty string')
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise FastForwardError(f'{where}: "answer" must be a string or a number, got {type(answer).__name__}')
        answer = answer if isinstance(answer, str) else json.dumps(answer)
        if not answer.strip():
            raise FastForwardError(f'{where}: "answer" is empty')
        if self.match == "regex":
            try:
                re.compile(answer)
            except (re.error, OverflowError, RecursionError) as exc:  # e.g. a{9999999999}, 1000 nested groups
                raise FastForwardError(f'{where}: "answer" is not a valid regular expression ({exc})') from exc
        ident = record.get("id", number)
        return Example(str(ident), prompt, answer, None, {"line": number})

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        self._check_split(split)
        n = self._size(n, len(self.records))
        return self.records[:n]

    def grade(self, example: Example, output: str) -> Grade:
        return grade_answer(output, example.reference, self.match, self.extract, self._extractor)


def grade_answer(
    output: str, answer: str, match: str = "exact", extract: str = "final", pattern: re.Pattern | None = None
) -> Grade:
    """An output graded against an answer as the module docstring says (`pattern`: `extract` compiled,
    when the caller keeps it compiled)."""
    text, raw, answer = output.strip(), answer, answer.strip()
    pattern = pattern if pattern is not None else extractor(extract)
    if pattern is not None:
        found = pattern.findall(text)
        if not found:
            return Grade(False, 0.0, f"malformed: nothing matched extract={extract!r}")
        last = found[-1]
        text = (last[0] if isinstance(last, tuple) else last).strip()
    if match == "exact":
        got, want = as_number(text), as_number(answer)
        correct = got == want if got is not None and want is not None else text == answer
    elif match == "contains":
        correct = answer in text
    else:
        correct = re.search(raw, text) is not None
    if correct:
        return Grade(True, 1.0, match)
    if not text:
        return Grade(False, 0.0, "malformed: empty output")
    shown = text if len(text) <= 80 else text[:77] + "..."
    return Grade(False, 0.0, f"{match} match failed: got {shown!r}, expected {answer!r}")
