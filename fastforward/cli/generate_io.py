"""What `fastforward generate` reads and prints, shared by its in-process path and its engine client
(`fastforward.cli.warm.client`): free of torch, so that the client prints exactly what the in-process
path prints without importing a model library."""

from __future__ import annotations

import json
import sys
from typing import Any

from fastforward.errors import FastForwardError

NO_PROMPTS = "no prompts: give them as arguments or one per line on stdin"


def read_prompts() -> list[str]:
    """The non-blank lines of stdin, read as bytes so that text which is not UTF-8 is named, not garbled."""
    if sys.stdin.isatty():
        print("fastforward generate: reading prompts from stdin, one per line (Ctrl-D to end)", file=sys.stderr)
    prompts = []
    for number, raw in enumerate(sys.stdin.buffer, 1):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            raise FastForwardError(
                f"stdin line {number} is not UTF-8 text (byte {raw[exc.start]:#04x} at byte offset {exc.start}); "
                "convert it, e.g. with `iconv -f latin1 -t utf-8`"
            ) from None
        if line.strip():
            prompts.append(line)
    return prompts


def print_report(record: dict[str, Any], summary: str, warning: str | None, as_json: bool, streamed: str = "") -> None:
    """Print one prompt's generation: its JSON record, or its text (the part not `streamed` already) and
    its figures (`summary`) on stderr; a warning first."""
    if warning:
        print(warning, file=sys.stderr)
    if as_json:
        print(json.dumps(record), flush=True)
        return
    text = record["text"]
    print(text[len(streamed) :] if text.startswith(streamed) else "", flush=True)
    print(summary, file=sys.stderr)


def say_interrupted(completed: int, total: int) -> None:
    print(f"fastforward generate: {completed} of {total} prompts completed before the interrupt", file=sys.stderr)
