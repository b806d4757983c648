"""Infilling tasks: a middle line is hidden between a prefix (the example's prompt) and a suffix.

* `arithmetic-infill`: a worked solution with one of its calculation lines hidden. The lines
  after it use that line's result, so the middle is well defined and graded by exact match.
* `arithmetic-number-infill`: one number of the problem statement hidden. The prefix says nothing
  about it; the suffix (the rest of the problem and the worked solution, which computes with that
  number) gives it away, so only a decoder that reads the suffix can do better than a guess.
* `pycode-infill`: one non-blank line of a standard-library file, given the lines before and
  `suffix_lines` lines after.

An example's `prompt` is the prefix, `meta["suffix"]` the suffix, `reference` the hidden line.
The gap's length is the reference's token count under the model's tokenizer (the caller's job,
`evaluate` does it). Grades: exact match (after stripping surrounding blanks) is correct; the score is
ROUGE-L F1 (Google's `rouge-score`, its default tokenizer: lower case, words and numbers only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from rouge_score import rouge_scorer

from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, option
from fastforward.tasks.arithmetic import ArithmeticTask
from fastforward.tasks.base import Example, Grade, Task, seeded_rng
from fastforward.tasks.pycode import PyCodeTask


class _InfillGrading(Task):
    """Exact match of the middle, ROUGE-L F1 as the score."""

    infilling = True

    @cached_property
    def _rouge(self) -> rouge_scorer.RougeScorer:
        return rouge_scorer.RougeScorer(["rougeL"])

    def grade(self, example: Example, output: str) -> Grade:
        got, want = output.strip(), example.reference.strip()
        score = self._rouge.score(want, got)["rougeL"].fmeasure if got else 0.0
        if got == want:
            return Grade(True, 1.0, "exact")
        return Grade(False, score, f"got {got[:60]!r}, expected {want[:60]!r}")


class ArithmeticInfillTask(_InfillGrading, ArithmeticTask):
    """A calculation line of a worked solution, between the problem with the lines before it and
    the lines after it (the final `#### n` line is never hidden)."""

    name = "arithmetic-infill"
    max_new_tokens = 32

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        rng = seeded_rng("arithmetic-infill", split, seed)
        out = []
        for example in super().examples(split, n, seed):
            lines = (example.completion or "").split("\n")
            if len(lines) < 2:
                raise FastForwardError(f"problem {example.id} has no calculation line to hide")
            hidden = rng.randrange(len(lines) - 1)
            prefix = example.prompt + "".join(line + "\n" for line in lines[:hidden])
            suffix = "".join("\n" + line for line in lines[hidden + 1 :])
            meta = {"suffix": suffix, "answer": example.reference, "hidden_line": hidden}
            out.append(Example(example.id, prefix, lines[hidden], example.completion, meta))
        return out


class ArithmeticNumberInfillTask(_InfillGrading, ArithmeticTask):
    """A number of the problem statement, between the text before it and the rest of the problem
    with its worked solution. Only numbers the solution writes out are hidden, so the suffix always
    determines the middle; the prefix at most narrows it (numbers are drawn at random, some only so
    that a division comes out whole: AR from the prefix gets about one in ten)."""

    name = "arithmetic-number-infill"
    max_new_tokens = 8
    NUMBER = re.compile(r" ?(?<=[ $])(\d+)\b")  # " 3" (with its space: one token) or the 10 of "$10"

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        rng = seeded_rng("arithmetic-number-infill", split, seed)
        out = []
        for example in super().examples(split, n, seed):
            solution = example.completion or ""
            question_at = example.prompt.rstrip().rfind(". ") + 1  # the question names no new number
            hideable = [
                m
                for m in self.NUMBER.finditer(example.prompt[:question_at])
                if re.search(rf"\b{m.group(1)}\b", solution)
            ]
            if not hideable:
                raise FastForwardError(f"problem {example.id} has no number that its solution uses")
            hidden = rng.choice(hideable)
            prefix, middle = example.prompt[: hidden.start()], hidden.group(0)
            suffix = example.prompt[hidden.end() :] + solution
            meta = {"suffix": suffix, "answer": example.reference}
            out.append(Example(example.id, prefix, middle, example.completion, meta))
        return out


@dataclass(eq=False)
class PyCodeInfillTask(_InfillGrading, PyCodeTask):
    """A line of standard-library Python between the lines before it and `suffix_lines` after it."""

    name = "pycode-infill"

    lines: int = field(default=1, init=False)  # PyCodeTask's: the middle is one line
    train_lines: int = field(default=16, init=False)  # PyCodeTask's: no training records
    suffix_lines: int = option(8, "lines after the middle", AT_LEAST_ONE)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.max_new_tokens = 40
        self.stop = ()

    def describe(self) -> dict:
        return {**super().describe(), "suffix_lines": self.suffix_lines}

    def _example(self, rel: str, lines: list[str], cut: int) -> Example | None:
        context = lines[max(0, cut - self.context_lines) : cut]
        while context and sum(map(len, context)) > self.max_prompt_chars:
            context = context[1:]
        middle = lines[cut].rstrip("\n")
        after = "".join(lines[cut + 1 : cut + 1 + self.suffix_lines]).rstrip("\n")
        if not context or not middle.strip() or not after.strip():
            return None
        meta = {"file": rel, "line": cut + 1, "suffix": "\n" + after}
        return Example(f"{rel}:{cut + 1}", "".join(context), middle, None, meta)
