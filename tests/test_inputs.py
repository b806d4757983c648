"""Bad JSONL input files get a clear error naming the file, line and problem (exit code 2), never a traceback;
what each reader accepts is what a reference parse of the bytes gives."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
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
from fastforward.training.trajectories.records import Trajectory, read_trajectories
from fastforward.training.trajectories.sources import read_prompts
from fastforward.training.trajectories.writer import collect

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


# ---- property-based: a reader returns what a reference parse of the bytes gives, or names the line --------
class Refused(Exception):
    """A refusal the reference expects: the reader's message names this line (None: the whole file) and words."""

    def __init__(self, line: int | None, *words: str):
        super().__init__(line, *words)
        self.line, self.words = line, words


def reference_lines(content: bytes, complete_only: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line as `json.loads` reads it (a UTF-8 BOM first is dropped,
    a line ends at "\n" and its "\r"s go); a line that is not UTF-8, JSON or an object is Refused, as is a
    file without objects. complete_only: a last line without "\n" is left out (a torn trajectory line)."""
    lines = content.removeprefix(BOM).split(b"\n")
    found = False
    for number, raw in enumerate(lines[:-1] if complete_only else lines, start=1):
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            raise Refused(number, "not UTF-8") from None
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise Refused(number, "not valid JSON") from None
        except (ValueError, RecursionError):
            raise Refused(number, "not usable JSON") from None
        if not isinstance(value, dict):
            raise Refused(number, "expected an object")
        found = True
        yield number, value
    if not found:
        raise Refused(None, "has no records")


def data_records(lines: Iterator[tuple[int, dict]]) -> list[dict]:
    """Training data: prompt and completion, or only text, each a non-empty string."""
    records = []
    for number, record in lines:
        if set(record) not in ({"prompt", "completion"}, {"text"}):
            raise Refused(number, "'prompt' and 'completion', or only 'text'")
        bad = next((key for key, value in record.items() if not isinstance(value, str) or not value), None)
        if bad is not None:
            raise Refused(number, repr(bad))
        records.append(record)
    return records


def task_examples(lines: Iterator[tuple[int, dict]], regex: bool = False) -> list[list[str]]:
    """A task file: (id, prompt, answer) per line; a number as the answer is its JSON text."""
    examples = []
    for number, record in lines:
        if "prompt" not in record or "answer" not in record:
            raise Refused(number, '"prompt" and "answer"')
        prompt, answer = record["prompt"], record["answer"]
        if not isinstance(prompt, str) or not prompt:
            raise Refused(number, '"prompt"')
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise Refused(number, '"answer"')
        answer = answer if isinstance(answer, str) else json.dumps(answer)
        if not answer.strip():
            raise Refused(number, '"answer"')
        if regex:
            try:
                re.compile(answer)
            except Exception:  # whatever re raises, the reader must say which field
                raise Refused(number, '"answer"') from None
        examples.append([str(record.get("id", number)), prompt, answer])
    return examples


def prompt_records(lines: Iterator[tuple[int, dict]]) -> list[list[str] | None]:
    """A prompt file: the non-empty string prompts, their ids (the "id" given, else the count so far) and
    their completions when every record has a non-empty string one (else None)."""
    prompts, ids, completions = [], [], []
    for number, record in lines:
        if not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise Refused(number, '"prompt"')
        prompts.append(record["prompt"])
        ids.append(str(record.get("id", len(ids))))
        completions.append(record.get("completion"))
    return [prompts, ids, completions if all(isinstance(c, str) and c for c in completions) else None]


def problem_records(lines: Iterator[tuple[int, dict]]) -> list[dict]:
    """HumanEval problems: every field of PROBLEM a string; a refusal names each one missing."""
    problems = []
    for number, record in lines:
        missing = [key for key in PROBLEM if not isinstance(record.get(key), str)]
        if missing:
            raise Refused(number, *map(repr, missing))
        problems.append(record)
    return problems


def trajectory_records(lines: Iterator[tuple[int, dict]]) -> list[dict]:
    """A trajectory file's records in prompt order, each of which round-trips."""
    trajectories = []
    for number, record in lines:
        try:
            trajectory = Trajectory.from_record(record)
        except FastForwardError:
            raise Refused(number) from None
        assert Trajectory.from_record(trajectory.to_record()) == trajectory
        trajectories.append(trajectory)
    return [t.to_record() for t in sorted(trajectories, key=lambda t: t.index)]


# name: (the reader, its result as JSON values; the reference's result for the reference lines of the bytes)
READERS: dict[str, tuple[Callable[[Path], object], Callable[[Iterator[tuple[int, dict]]], object]]] = {
    "jsonl": (lambda path: [list(item) for item in jsonl.read_jsonl(path, "file")], lambda lines: [*map(list, lines)]),
    "data": (data.read_jsonl, data_records),
    "task": (lambda path: [[e.id, e.prompt, e.reference] for e in JsonlTask(str(path)).examples()], task_examples),
    "regex task": (
        lambda path: [[e.id, e.prompt, e.reference] for e in JsonlTask(str(path), match="regex").examples()],
        lambda lines: task_examples(lines, regex=True),
    ),
    "prompts": (lambda path: list(read_prompts(path)), prompt_records),
    "problems": (load_problems, problem_records),
    "trajectories": (lambda path: [t.to_record() for t in read_trajectories(path)], trajectory_records),
}
FUZZ = settings(max_examples=75, deadline=None, database=None)
KEYS = ["prompt", "completion", "text", "answer", "id", *Trajectory.__dataclass_fields__, "states", "fixed", *PROBLEM]
# Finite numbers only: an infinite one is test_trajectory_with_an_infinite_number.
NAMES = st.sampled_from(KEYS) | st.text(max_size=4)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=4),
    max_leaves=12,
)
TEXT = st.text(max_size=6)
IDS = st.lists(st.integers(0, 300), max_size=3)
RECORDS = (  # records some reader accepts, or almost
    st.fixed_dictionaries({"text": TEXT})
    | st.fixed_dictionaries({"prompt": TEXT, "completion": TEXT})
    | st.fixed_dictionaries(
        {"prompt": TEXT, "answer": TEXT | st.integers() | st.floats(allow_infinity=False)}, optional={"id": JSON}
    )
    | st.fixed_dictionaries(dict.fromkeys(PROBLEM, TEXT))
    | st.fixed_dictionaries(
        {
            "index": st.integers(0, 3),
            "prompt_ids": IDS,
            "block_size": st.integers(1, 3),
            "blocks": st.lists(st.fixed_dictionaries({"states": st.lists(IDS, max_size=2), "fixed": IDS}), max_size=2),
        },
        optional={"id": TEXT, "prompt": TEXT, "correct": st.booleans()},
    )
)
LINE = st.dictionaries(NAMES, JSON, max_size=5) | RECORDS | JSON  # mostly objects, to get past the first check
WORD = st.text(min_size=1, max_size=6).filter(str.strip)


def trajectory(n: int) -> st.SearchStrategy[dict]:
    """Trajectory records of block size n."""
    block = st.lists(st.integers(0, 300), min_size=n, max_size=n)
    blocks = st.lists(st.fixed_dictionaries({"states": st.lists(block, max_size=2), "fixed": block}), max_size=2)
    return st.fixed_dictionaries(
        {"index": st.integers(0, 3), "prompt_ids": IDS, "block_size": st.just(n), "blocks": blocks},
        optional={"id": WORD, "prompt": WORD, "correct": st.booleans()},
    )


KINDS = {  # files of one reader's records, mostly good ones
    "data": st.fixed_dictionaries({"text": WORD}) | st.fixed_dictionaries({"prompt": WORD, "completion": WORD}),
    "task": st.fixed_dictionaries(
        {"prompt": WORD, "answer": WORD | st.integers() | st.floats(allow_infinity=False)}, optional={"id": JSON}
    ),
    "prompts": st.fixed_dictionaries({"prompt": WORD}, optional={"id": JSON, "answer": JSON, "completion": JSON}),
    "problems": st.fixed_dictionaries(dict.fromkeys(PROBLEM, WORD), optional={"extra": JSON}),
    "trajectories": st.integers(1, 3).flatmap(trajectory),
}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def reads_as_the_reference(path: Path, content: bytes, readers: Iterable[str] = READERS) -> None:
    """Each reader returns what its reference gives for `content` (stored at `path`, maybe compressed), or
    refuses with a FastForwardError naming the file and line (and field) the reference names."""
    for name in readers:
        read, reference = READERS[name]
        try:
            want = reference(reference_lines(content, complete_only=name == "trajectories"))
        except Refused as refused:
            with pytest.raises(FastForwardError) as error:
                read(path)
            message = str(error.value)
            where = f"{path}:{refused.line}: " if refused.line else f"{path} has no records"
            assert where in message and all(word in message for word in refused.words), (name, message, refused)
        else:
            assert json.dumps(read(path)) == json.dumps(want), name  # as text: NaN equals NaN


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


@FUZZ
@given(st.binary(max_size=300) | st.lists(st.binary(max_size=40), max_size=6).map(b"\n".join))
def test_random_bytes(scratch, content):
    reads_as_the_reference(write(scratch / "f.jsonl", content), content)


@FUZZ
@given(st.lists(st.tuples(LINE, st.booleans()), max_size=5), st.sampled_from(["\n", "\r\n"]), st.booleans())
def test_random_json_values(scratch, values, newline, last_newline):
    text = newline.join(json.dumps(value, ensure_ascii=ascii) for value, ascii in values) + newline * last_newline
    content = text.encode("utf-8", "surrogatepass")
    reads_as_the_reference(write(scratch / "f.jsonl", content), content)


@pytest.mark.parametrize("kind", KINDS)
def test_files_of_one_kind(scratch, kind):
    @FUZZ
    @given(st.lists(KINDS[kind], min_size=1, max_size=4))
    def reads(records: list[dict]) -> None:
        content = "".join(json.dumps(record) + "\n" for record in records).encode("utf-8", "surrogatepass")
        reads_as_the_reference(write(scratch / "f.jsonl", content), content)

    reads()


@FUZZ
@given(st.lists(st.text(max_size=40), max_size=5))
def test_random_text(scratch, lines):
    content = "\n".join(lines).encode("utf-8", "surrogatepass")
    reads_as_the_reference(write(scratch / "f.jsonl", content), content)


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 300), st.integers(0, 255))
def test_random_gzip(scratch, content, cut, flip):
    """A .gz file reads as its decompressed bytes; one that does not decompress is refused, naming it."""
    packed = bytearray(gzip.compress(content))
    packed[cut % len(packed)] ^= flip
    path = write(scratch / "f.jsonl.gz", bytes(packed[: len(packed) - cut % 7]))
    try:
        plain = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error):
        for name, (read, _) in READERS.items():
            if name != "trajectories":  # read as they are: trajectory files are never compressed
                with pytest.raises(FastForwardError, match=re.escape(str(path))):
                    read(path)
    else:
        reads_as_the_reference(path, plain, [name for name in READERS if name != "trajectories"])
