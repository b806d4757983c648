"""`pycode`: next-line prediction on real Python, the local CPython standard library.

Source: every `.py` file under `sysconfig.get_paths()["stdlib"]` (or under `root=`), skipping tests
(`test`/`tests`/`idle_test` folders, `test_*.py`), `site-packages`, `idlelib`, `turtledemo`,
`lib2to3`, `ensurepip`, `pydoc_data`, `encodings`, generated `_sysconfigdata*`, files over 500 kB and
files that are not UTF-8. The examples depend on the Python version installed (its stdlib is the
corpus); on one machine they are a pure function of (knobs, split, n, seed).

An example cuts a file at a line boundary before a non-blank line:

- `prompt`: the up to `context_lines` lines before the cut (fewer when they exceed
  `max_prompt_chars`; whole lines only), *without* the newlines at its end (`meta["newlines"]`
  counts them: one, or more after blank lines);
- `reference`: the next `lines` line(s), each stripped of trailing whitespace, joined by newlines;
- `completion`: those newlines and the next `train_lines` lines verbatim (the training target).

The prompt stops short of its newlines because BPE tokenizers merge a newline with what follows it
(`"\n    "`, `"\n\n"`): a prompt ending in a bare newline token puts the model at a boundary it
never saw in training, and it answers with a blank line or the wrong indentation. Ending the prompt
mid-line lets the model write the line break and the next line's indentation itself, as in real code.

Grading: the output must start with exactly those newlines (one when `meta` does not say); after
them, its first `lines` line(s), stripped of trailing whitespace, must equal the reference's (leading
indentation counts). `score` is the fraction of those lines that match. How far a decoder agrees
with the same model's greedy AR output is measured on token ids by
`fastforward.decoding.metrics.token_agreement`, not here.

Splits are disjoint by file: a file is in the test split when the hash of its path relative to the
root falls below `test_fraction`.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, PROPER_FRACTION, at_least, option
from fastforward.tasks.base import Example, Grade, Task, seeded_rng, stable_hash

SKIP_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib", "turtledemo", "lib2to3",
    "ensurepip", "pydoc_data", "encodings", "__pycache__", "lib-dynload", "__phello__",
}  # fmt: skip
MAX_FILE_BYTES = 500_000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_file(name: str) -> bool:
    return not name.endswith(".py") or name.startswith(("test_", "_sysconfigdata")) or name.endswith("_test.py")


@dataclass(eq=False)
class PyCodeTask(Task):
    """Next-line prediction on standard-library Python; see the module docstring."""

    name = "pycode"
    splits = ("train", "test")
    default_size = 200

    lines: int = option(1, "lines to predict", AT_LEAST_ONE)
    context_lines: int = option(40, "lines of the prompt at most", AT_LEAST_ONE)
    max_prompt_chars: int = option(2000, "characters of the prompt at most (whole lines)", at_least(80))
    train_lines: int = option(16, "lines of a training completion", AT_LEAST_ONE)
    test_fraction: float = option(0.1, "share of files in the test split", PROPER_FRACTION)
    # kept as the folder's Path
    root: str | Path | None = option(None, "folder of .py files (default: the standard library)", kind=str)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.root = Path(self.root) if self.root else stdlib_root()
        if not self.root.is_dir():
            raise FastForwardError(f"pycode root {self.root} is not a folder; give root= a folder of .py files")
        self.max_new_tokens = 40 * self.lines
        self.stop = ("\n",) if self.lines == 1 else ()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "lines": self.lines,
            "context_lines": self.context_lines,
            "max_prompt_chars": self.max_prompt_chars,
            "train_lines": self.train_lines,
            "test_fraction": self.test_fraction,
            "root": str(self.root),
        }

    # ---- files and splits ----------------------------------------------------------------------------
    @cached_property
    def files(self) -> dict[str, list[str]]:
        """Relative paths of the corpus files (sorted, '/'-separated) in each split."""
        out: dict[str, list[str]] = {"train": [], "test": []}
        for folder, dirs, names in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(("config-", ".")))
            for name in sorted(names):
                path = Path(folder, name)
                if _skip_file(name) or path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
                    continue
                rel = path.relative_to(self.root).as_posix()
                out[self.split_of(rel)].append(rel)
        if not out["train"] or not out["test"]:
            raise FastForwardError(
                f"found too few Python files under {self.root} to make both splits "
                f"({len(out['train'])} train, {len(out['test'])} test); give root= a bigger folder"
            )
        return out

    def split_of(self, rel_path: str) -> str:
        return "test" if stable_hash("pycode:" + rel_path) < self.test_fraction else "train"

    def _read_lines(self, rel: str) -> list[str] | None:
        try:
            text = (self.root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            return None
        return text.replace("\r\n", "\n").replace("\r", "\n").splitlines(keepends=True)

    # ---- examples ------------------------------------------------------------------------------------
    def _example(self, rel: str, lines: list[str], cut: int) -> Example | None:
        context = lines[max(0, cut - self.context_lines) : cut]
        while context and sum(map(len, context)) > self.max_prompt_chars:
            context = context[1:]
        if not context:
            return None
        text = "".join(context)
        prompt = text.rstrip("\n")  # the model writes the line break itself (module docstring)
        newlines = len(text) - len(prompt)
        if not prompt.strip() or newlines == 0:
            return None
        reference = "\n".join(line.rstrip() for line in lines[cut : cut + self.lines])
        completion = text[len(prompt) :] + "".join(lines[cut : cut + self.train_lines])
        meta = {"file": rel, "line": cut + 1, "newlines": newlines}
        return Example(f"{rel}:{cut + 1}", prompt, reference, completion, meta)

    def examples(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
        """`n` cuts (default 200) at distinct random non-blank lines of random files of the split."""
        self._check_split(split)
        n = self._size(n, self.default_size)
        files = self.files[split]
        rng = seeded_rng("pycode", split, seed)
        cache: dict[str, list[str] | None] = {}
        seen: set[tuple[str, int]] = set()
        out: list[Example] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise FastForwardError(f"found only {len(out)} {split} examples of the {n} asked for; ask for fewer")
            rel = rng.choice(files)
            if rel not in cache:
                if len(cache) > 64:  # keep memory bounded on long runs
                    cache.clear()
                cache[rel] = self._read_lines(rel)
            lines = cache[rel]
            if not lines or len(lines) <= self.lines:
                continue
            cut = rng.randrange(1, len(lines) - self.lines + 1)
            if not lines[cut].strip() or (rel, cut) in seen:
                continue
            example = self._example(rel, lines, cut)
            if example is None:
                continue
            seen.add((rel, cut))
            out.append(example)
        return out

    def grade(self, example: Example, output: str) -> Grade:
        want = example.reference.split("\n")
        if not output.strip():
            return Grade(False, 0.0, "malformed: empty output")
        newlines = (example.meta or {}).get("newlines", 1)
        if not output.startswith("\n" * newlines):  # it went on with the prompt's last line
            return Grade(False, 0.0, f"no line break first: got {output[:40]!r}, expected {newlines} newline(s)")
        got = [line.rstrip() for line in output[newlines:].split("\n")[: len(want)]]
        matches = sum(a == b for a, b in zip(got, want, strict=False))
        correct = matches == len(want) and len(got) == len(want)
        if correct:
            return Grade(True, 1.0, "exact")
        i = next((i for i, w in enumerate(want) if i >= len(got) or got[i] != w), 0)
        seen = repr(got[i]) if i < len(got) else "nothing"
        return Grade(False, matches / len(want), f"line {i + 1}: got {seen}, expected {want[i]!r}")

    # ---- training data -------------------------------------------------------------------------------
    def training_records(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """{"prompt": a file prefix, "completion": the next `train_lines` lines} from train files."""
        return [{"prompt": e.prompt, "completion": e.completion or ""} for e in self.examples("train", n, seed)]

    def text_records(self, n: int | None = None, seed: int = 0, max_chars: int = 4000) -> list[dict[str, str]]:
        """{"text"} chunks of whole lines (≤ max_chars each) of the train files, files in seeded order.

        n=None gives every chunk of every train file (the whole train corpus)."""
        if max_chars < 80:
            raise FastForwardError(f"max_chars must be at least 80, got {max_chars}")
        n = self._size(n, None)
        files = list(self.files["train"])
        seeded_rng("pycode-text", seed).shuffle(files)
        out: list[dict[str, str]] = []
        for rel in files:
            chunk: list[str] = []
            size = 0
            for line in self._read_lines(rel) or []:
                if chunk and size + len(line) > max_chars:
                    if "".join(chunk).strip():
                        out.append({"text": "".join(chunk)})
                    chunk, size = [], 0
                if len(line) <= max_chars:
                    chunk.append(line)
                    size += len(line)
            if "".join(chunk).strip():
                out.append({"text": "".join(chunk)})
            if n is not None and len(out) >= n:
                return out[:n]
        return out
