"""`arithmetic`: GSM8K-style multi-step word problems from a seeded generator.

Each problem is a short story from one of several themes (shopping, travel, collecting, savings,
recipes, wages, gardening, reading) with names, items and units, and needs 2–4 integer operations
(+, -, *, and / only where it divides exactly; every intermediate value stays positive). The worked
solution has one line per operation, each containing `a <op> b = c`, and ends with `#### <answer>`:

    Prompt:     Mia has $40. She buys 3 notebooks that cost $6 each. She earns $12 washing cars.
                How many dollars does Mia have now?
    Completion: The notebooks cost 3 * 6 = 18 dollars.
                Mia has 40 - 18 = 22 dollars left.
                Mia now has 22 + 12 = 34 dollars.
                #### 34

Grading: the answer is the number on the first `#### <number>` in the output (commas, a `$` and a
`.0` are accepted; text after it is ignored). With `strict=False` an output without `####` is graded
by its last number instead, for models never taught the format. No number → wrong ("malformed").

Splits: a problem belongs to the test split when the hash of its prompt text falls below
`test_fraction`, else to train, so the splits never share a prompt whatever the seeds and knobs.
Within a split, problems are distinct. Everything is a pure function of (knobs, split, n, seed).

Difficulty knobs: `min_ops`/`max_ops` (operations per problem, 1–6), `max_number` (largest amount:
money, distances, counts that are added or subtracted), `max_factor` (largest multiplier, count of
items bought, divisor), `themes` (a subset of THEMES).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from random import Random

from fastforward.errors import FastForwardError
from fastforward.options import PROPER_FRACTION, at_least, option, within
from fastforward.tasks.arithmetic_stories import (
    CHORES,
    COLLECTIBLES,
    FOODS,
    FRIENDS,
    GOODS,
    INGREDIENTS,
    MIN_OPS,
    NAMES,
    PLANTS,
    THEMES,
    THINGS,
    VEHICLES,
    WEEKDAYS,
    Story,
)
from fastforward.tasks.arithmetic_wording import (
    CONTAINERS,
    CROWDS,
    DAYS,
    GROUPS,
    ITEMS,
    MORE_NAMES,
    WORDING_THEMES,
    reword,
)
from fastforward.tasks.base import Example, Grade, Task, seeded_rng, stable_hash

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_FINAL = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)
_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def _words_to_mask() -> re.Pattern:
    """Every name, pronoun and item word the generator fills its templates with, longest first."""
    words = {name for name, _ in NAMES + MORE_NAMES} | {"she", "he", "her", "him", "his", "She", "He", "Her", "His"}
    words |= {*FRIENDS, *THINGS, *CHORES, *COLLECTIBLES, *FOODS, *INGREDIENTS, *WEEKDAYS, *DAYS}
    words |= {w for pairs in (GOODS, VEHICLES, ITEMS, CONTAINERS, GROUPS) for pair in pairs for w in pair}
    words |= {w for crowd in CROWDS for w in crowd}
    words |= {w for triple in PLANTS for w in triple}
    return re.compile(r"\b(" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")\b")


_MASKED_WORDS = _words_to_mask()


def masked(text: str) -> str:
    """A problem's text with its names, pronouns and items replaced by `_`: two problems that differ only
    in those are the same problem."""
    return _MASKED_WORDS.sub("_", text)


def apart_from(test: Sequence[Example], train: Sequence[Example]) -> list[Example]:
    """The test problems that equal no train problem once masked and share no train problem's worked
    solution. The split hashes the prompt text, so a template filled with other names and items crosses
    it: of 300 test problems (2-3 operations, numbers to 20, factors to 5; seed 1), 65 equal one of 3,000
    train problems (seed 0) once masked (units too), 29 of them sharing its worked solution; 235 remain."""
    prompts = {masked(e.prompt) for e in train}
    solutions = {e.completion for e in train}
    return [e for e in test if masked(e.prompt) not in prompts and e.completion not in solutions]


def parse_answer(output: str, strict: bool = True) -> Decimal | None:
    """The number after the first `#### `, or (strict=False) the last number in the text; None if absent."""
    match = _FINAL.search(output)
    if match is None and not strict:
        numbers = _ANY_NUMBER.findall(output)
        text = numbers[-1] if numbers else None
    else:
        text = match.group(1) if match else None
    if text is None:
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def check_solution(completion: str) -> int:
    """Recompute every `a op b = c` line of a worked solution; return its `####` answer (ValueError if wrong)."""
    for a, op, b, c in _STEP.findall(completion):
        a, b, c = int(a), int(b), int(c)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
        if value != c:
            raise ValueError(f"wrong step {a} {op} {b} = {c}")
    answer = parse_answer(completion)
    if answer is None:
        raise ValueError("no #### line")
    return int(answer)


@dataclass(eq=False)
class ArithmeticTask(Task):
    """GSM8K-style word problems; see the module docstring."""

    name = "arithmetic"
    splits = ("train", "test")
    default_size = 500
    max_new_tokens = 192
    stop = ()

    min_ops: int = option(2, "fewest operations in a problem", within(1, 6))
    max_ops: int = option(4, "most operations in a problem", within(1, 6))
    max_number: int = option(100, "largest number a problem starts from", at_least(10))
    max_factor: int = option(10, "largest factor of a multiplication or division", at_least(2))
    # a list from Python, kept as the list of themes that fit max_ops
    themes: str | list[str] | None = option(None, "comma-separated story themes (default: all)", kind=str)
    test_fraction: float = option(0.2, "share of problems in the test split", PROPER_FRACTION)
    strict: bool = option(True, "grade only a '#### n' answer line (else the last number)")
    phrasing: str = option(
        "templates",
        "templates (each fact said one way) or varied (everyday stories, facts said many ways)",
        choices=("templates", "varied"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_ops > self.max_ops:
            raise FastForwardError(f"need min_ops <= max_ops, got min_ops={self.min_ops}, max_ops={self.max_ops}")
        if self.max_factor > self.max_number:
            raise FastForwardError(f"max_factor must be at most max_number ({self.max_number}), got {self.max_factor}")
        themes = self.themes
        if isinstance(themes, str):
            themes = [t.strip() for t in themes.split(",") if t.strip()]
        themes = themes or list(THEMES)
        unknown = [t for t in themes if t not in THEMES]
        if unknown:
            raise FastForwardError(f"unknown arithmetic theme(s) {unknown}; choose from: {', '.join(THEMES)}")
        self.themes = [t for t in themes if MIN_OPS.get(t, 1) <= self.max_ops]
        if not self.themes:
            raise FastForwardError(f"themes {themes} all need more than max_ops={self.max_ops} operations")

    def describe(self) -> dict:
        return {
            "name": self.name,
            "min_ops": self.min_ops,
            "max_ops": self.max_ops,
            "max_number": self.max_number,
            "max_factor": self.max_factor,
            "themes": self.themes,
            "test_fraction": self.test_fraction,
            "strict": self.strict,
            **({"phrasing": self.phrasing} if self.phrasing != "templates" else {}),
        }

    def split_of(self, prompt: str) -> str:
        """The split a problem belongs to (by the hash of its prompt text)."""
        return "test" if stable_hash("arithmetic:" + prompt) < self.test_fraction else "train"

    def problem(self, rng: Random) -> tuple[str, str, int]:
        """One random problem: (prompt, worked solution, answer)."""
        varied = self.phrasing == "varied"
        theme = rng.choice(list(WORDING_THEMES) if varied and rng.random() < 0.5 else self.themes)
        ops = rng.randint(max(self.min_ops, MIN_OPS.get(theme, 1)), self.max_ops)
        story = Story(rng, self.max_number, self.max_factor)
        answer = {**THEMES, **WORDING_THEMES}[theme](story, ops)
        text = reword(rng, story) if varied else " ".join([*story.sentences, story.question])
        prompt = text + "\n"
        solution = "\n".join([*story.steps, f"#### {answer}"])
        return prompt, solution, answer

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        self._check_split(split)
        n = self._size(n, self.default_size)
        rng = seeded_rng("arithmetic", split, seed)
        seen: set[str] = set()
        out: list[Example] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 100 * n + 1000:
                raise FastForwardError(
                    f"found only {len(out)} distinct {split} problems of the {n} asked for; "
                    "ask for fewer or widen the knobs (max_ops, max_number, max_factor, themes)"
                )
            prompt, solution, answer = self.problem(rng)
            if prompt in seen or self.split_of(prompt) != split:
                continue
            seen.add(prompt)
            out.append(Example(f"{split}-{seed}-{len(out)}", prompt, str(answer), solution))
        return out

    def grade(self, example: Example, output: str) -> Grade:
        got = parse_answer(output, self.strict)
        if got is None:
            need = "a '#### <number>' line" if self.strict else "a number"
            return Grade(False, 0.0, f"malformed: no answer found (need {need})")
        expected = Decimal(example.reference)
        correct = got == expected
        return Grade(correct, float(correct), f"answer {got.normalize():f}, expected {example.reference}")

    def training_records(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        return [{"prompt": e.prompt, "completion": e.completion or ""} for e in self.examples("train", n, seed)]
