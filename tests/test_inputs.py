"""Bad JSONL input files get a clear error naming the file, line and problem (exit code 2), never a traceback."""

from __future__ import annotations

import contextlib
import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastforward import jsonl
from fastforward.cli import main
from fastforward.errors import FastForwardError
from fastforward.model.tiny import tiny_model
from fastforward.tasks import JsonlTask
from fastforward.tasks.humaneval import load_problems
from fastforward.training import data
from fastforward.training.jacobi_trajectories import Trajectory
from fastforward.training.trajectories import collect, read_prompts, read_trajectories

BOM = b"\xef\xbb\xbf"
DIRECTORY = "directory"
GOOD = {"train": b'{"text": "hi"}', "eval": b'{"prompt": "p", "answer": "a"}'}
PROBLEM = {"task_id": "t/0", "prompt": "def f():\n", "entry_point": "f", "canonical_solution": "    pass\n", "test": ""}

# (case, file content with {good} standing for a valid line of the command's format, what stderr must say after
# "<path>"; None: no file; DIRECTORY: a directory of that name)
CASES = [
    ("missing", None, r" does not exist; give a JSONL file of"),
    ("directory", DIRECTORY, r" is a directory, not a file; give a JSONL file of"),
    ("empty", b"", r" has no records; give a JSONL file of"),
    ("blank lines", b"\n   \n\r\n", r" has no records"),
    ("random bytes", b"\x1f\x8b\x08\x00\xa7\x01\n", r":1: not UTF-8 text \(byte 0x8b at column 2\); save the file"),
    ("latin-1", b'{good}\n{"x": "caf\xe9"}\n', r":2: not UTF-8 text \(byte 0xe9 at column 11\); save the"),
    ("BOM, bad line 2", BOM + b'{good}\n{"a" 1}\n', r":2: not valid JSON \(Expecting ':' delimiter at column 6\)"),
    ("malformed", b'{good}\n{"text": "a" "b"}\n', r":2: not valid JSON \(Expecting ',' delimiter at column 14\)"),
    ("cut short", b'{"a": "b",\n', r":1: not valid JSON \(Expecting property name .* at column 11\)"),
    ("cut short, CRLF", b'{good}\r\n{"a":\r\n', r":2: not valid JSON \(Expecting value at column 6\)"),
    ("extra data", b'{"a": 1} x\n', r":1: not valid JSON \(Extra data at column 10\)"),
    ("array", b'{good}\n["a", "b"]\n', r":2: expected an object \{\.\.\.\} on each line, got an array"),
    ("null", b"null\n", r":1: expected an object \{\.\.\.\} on each line, got null"),
    ("huge integer", b'{"a": ' + b"1" * 5000 + b"}\n", r":1: not usable JSON \(Exceeds the limit"),
    ("deep nesting", b"[" * 100_000 + b"\n", r":1: not usable JSON \(maximum recursion depth"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model().save(path)
    return path


def cli(command: str, path: Path, model_dir: Path, tmp_path: Path) -> list[str]:
    """The command line that makes `command` read `path` as its JSONL input."""
    if command == "train":
        return ["train", "--model", str(model_dir), "--data", str(path), "--out", str(tmp_path / "run"), "--steps", "1"]
    return ["eval", "--model", str(model_dir), "--task", str(path)]


def make(path: Path, content: bytes | str | None, good: bytes = b"") -> Path:
    if content == DIRECTORY:
        path.mkdir()
    elif content is not None:
        path.write_bytes(content.replace(b"{good}", good))
    return path


def fails_clearly(argv: list[str], capsys, message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # after any progress bar of loading the model
    assert last.startswith(f"fastforward {argv[0]}: error: ") and re.search(message, last), err


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize(("content", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_file_on_the_command_line(command, content, message, model_dir, tmp_path, capsys):
    path = make(tmp_path / "in.jsonl", content, GOOD[command])
    fails_clearly(cli(command, path, model_dir, tmp_path), capsys, re.escape(str(path)) + message)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_unreadable_file(command, model_dir, tmp_path, capsys, monkeypatch):
    path = make(tmp_path / "locked.jsonl", GOOD[command])
    real_open = Path.open

    def refuse(self: Path, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)  # chmod does not lock out root
    fails_clearly(cli(command, path, model_dir, tmp_path), capsys, r"cannot read .*locked\.jsonl: permission denied")


def test_bom_prefixed_files_are_read(tmp_path):
    path = make(tmp_path / "bom.jsonl", BOM + b'{"prompt": "p\xc3\xa9", "answer": "a", "completion": "c"}\n')
    assert list(jsonl.read_jsonl(path, "file")) == [(1, {"prompt": "pé", "answer": "a", "completion": "c"})]
    assert read_prompts(path) == (["pé"], ["0"], ["c"])
    assert JsonlTask(str(make(tmp_path / "t.jsonl", BOM + GOOD["eval"]))).examples()[0].prompt == "p"
    assert data.read_jsonl(make(tmp_path / "d.jsonl", BOM + GOOD["train"])) == [{"text": "hi"}]


def test_gzip_files(tmp_path, model_dir, capsys):
    good = make(tmp_path / "he.jsonl.gz", gzip.compress(BOM + json.dumps(PROBLEM).encode() + b"\n"))
    assert load_problems(good) == [PROBLEM]
    truncated = make(tmp_path / "cut.jsonl.gz", good.read_bytes()[:-9])
    plain = make(tmp_path / "plain.jsonl.gz", json.dumps(PROBLEM).encode())
    for path in (truncated, plain):
        argv = ["eval", "--model", str(model_dir), "--task", "humaneval", "--task-option", f"path={path}"]
        fails_clearly(argv, capsys, rf"HumanEval file {re.escape(str(path))} is not a valid gzip file")


def test_trajectory_and_prompt_files(tmp_path, model_dir, tiny, capsys):
    folder = make(tmp_path / "traj.jsonl", DIRECTORY)
    argv = ["train", "--model", str(model_dir), "--objective", "jacobi_forcing", "--trajectories", str(folder)]
    fails_clearly([*argv, "--out", str(tmp_path / "run")], capsys, "trajectory file .* is a directory, not a file")
    with pytest.raises(FastForwardError, match="trajectory file .* is a directory, not a file"):
        collect(tiny, ["hi"], folder, progress=False)
    with pytest.raises(FastForwardError, match=r"p\.jsonl:1: not UTF-8 text \(byte 0xff at column 13\)"):
        read_prompts(make(tmp_path / "p.jsonl", b'{"prompt": "\xff"}\n'))


@pytest.mark.parametrize("pattern", ["(unclosed", "a{99999999999}", "(" * 1000 + ")" * 1000])
def test_regex_answers_that_do_not_compile(tmp_path, pattern):
    path = make(tmp_path / "re.jsonl", json.dumps({"prompt": "p", "answer": pattern}).encode())
    with pytest.raises(FastForwardError, match=r"re\.jsonl:1: \"answer\" is not a valid regular expression"):
        JsonlTask(str(path), match="regex")


def test_trajectory_with_an_infinite_number(tmp_path):
    with pytest.raises(FastForwardError):
        read_trajectories(make(tmp_path / "inf.jsonl", b'{"block_size": 1e400}\n'))


# ---- property-based: whatever the bytes, a reader returns or raises FastForwardError --------------------
READERS: tuple[Callable[[Path], object], ...] = (
    lambda path: list(jsonl.read_jsonl(path, "file")),
    data.read_jsonl,
    lambda path: JsonlTask(str(path)),
    lambda path: JsonlTask(str(path), match="regex"),
    read_prompts,
    load_problems,
    read_trajectories,
)
FUZZ = settings(max_examples=75, deadline=None, database=None)
KEYS = ["prompt", "completion", "text", "answer", "id", *Trajectory.__dataclass_fields__, "states", "fixed", *PROBLEM]
# Finite numbers only: an infinite one is test_trajectory_with_an_infinite_number.
NAMES = st.sampled_from(KEYS) | st.text(max_size=4)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=4),
    max_leaves=12,
)
LINE = st.dictionaries(NAMES, JSON, max_size=5) | JSON  # mostly objects, to get past the first check


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def read_everywhere(path: Path, content: bytes) -> None:
    path.write_bytes(content)
    for read in READERS:
        with contextlib.suppress(FastForwardError):
            read(path)


@FUZZ
@given(st.binary(max_size=300) | st.lists(st.binary(max_size=40), max_size=6).map(b"\n".join))
def test_random_bytes(scratch, content):
    read_everywhere(scratch / "f.jsonl", content)


@FUZZ
@given(st.lists(st.tuples(LINE, st.booleans()), max_size=5), st.sampled_from(["\n", "\r\n"]))
def test_random_json_values(scratch, values, newline):
    text = newline.join(json.dumps(value, ensure_ascii=ascii) for value, ascii in values)
    read_everywhere(scratch / "f.jsonl", text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(st.lists(st.text(max_size=40), max_size=5))
def test_random_text(scratch, lines):
    read_everywhere(scratch / "f.jsonl", "\n".join(lines).encode("utf-8", "surrogatepass"))


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 300), st.integers(0, 255))
def test_random_gzip(scratch, content, cut, flip):
    packed = bytearray(gzip.compress(content))
    packed[cut % len(packed)] ^= flip
    read_everywhere(scratch / "f.jsonl.gz", bytes(packed[: len(packed) - cut % 7]))
