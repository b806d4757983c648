"""Reading JSONL files (one JSON object per line) with errors a user can act on, never a traceback.

Every reader of user-given JSONL (training data, task files, HumanEval problems, prompt and
trajectory files) goes through here, so each bad input gets the same message: a missing file, a
directory, an unreadable or corrupt file, bytes that are not UTF-8 (with the line, byte and
column), a line that is not JSON (with its real column) or not an object. Blank lines are skipped;
a UTF-8 byte order mark at the start is accepted; a `.gz` file is decompressed.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from fastforward.errors import FastForwardError

_BOM = b"\xef\xbb\xbf"
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _with_hint(message: str, hint: str) -> str:
    return f"{message}; {hint}" if hint else message


@contextmanager
def open_jsonl(path: Path, what: str, hint: str = "") -> Iterator[BinaryIO]:
    """The file opened for binary reading; I/O failures while the block reads it become FastForwardError.

    `what` names the file for the user ("data file"); `hint` says what to give instead when it is
    missing, a directory or empty.
    """
    if path.is_dir():
        raise FastForwardError(_with_hint(f"{what} {path} is a directory, not a file", hint))
    if not path.exists():
        raise FastForwardError(_with_hint(f"{what} {path} does not exist", hint))
    try:
        with path.open("rb") as f:
            yield f
    except PermissionError as exc:
        raise FastForwardError(f"cannot read {what} {path}: permission denied; make it readable (chmod +r)") from exc
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise FastForwardError(
            f"{what} {path} is not a valid gzip file ({exc}); recompress it, or drop .gz from a plain file's name"
        ) from exc
    except OSError as exc:
        raise FastForwardError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def parse_line(raw: bytes, path: Path, number: int) -> dict | None:
    """The object on line `number` (its raw bytes, newline included), or None for a blank line."""
    if number == 1 and raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FastForwardError(
            f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            "save the file as UTF-8"
        ) from exc
    # Only the line ending goes: an error at the end of the line would otherwise be placed on "line 2, column 1".
    text = text.rstrip("\r\n")
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FastForwardError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer of over 4300 digits, arrays nested 1000 deep
        raise FastForwardError(f"{path}:{number}: not usable JSON ({exc})") from exc
    if not isinstance(record, dict):
        got = "null" if record is None else _JSON_TYPES[type(record)]
        raise FastForwardError(f"{path}:{number}: expected an object {{...}} on each line, got {got}")
    return record


def read_jsonl(path: str | Path, what: str, hint: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; raises when the file holds no object at all."""
    path = Path(path)
    found = False
    with open_jsonl(path, what, hint) as raw:
        f = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
        for number, line in enumerate(f, start=1):
            record = parse_line(line, path, number)
            if record is not None:
                found = True
                yield number, record
    if not found:
        raise FastForwardError(_with_hint(f"{what} {path} has no records", hint))
