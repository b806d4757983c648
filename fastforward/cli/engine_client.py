"""`fastforward generate` as the client of a warm local engine (`fastforward engine start`): it sends its
own arguments to an engine that serves the same model and precision and prints what the engine sends,
exactly what `generate` prints in process, text streaming as it comes. It imports neither torch nor
transformers (the seconds a one-shot `generate` spends before its first token). Without an engine that
takes the request, `generate` decodes in process (`answer` returns None) and says why in one line."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

from fastforward.cli.generate_io import print_report, read_prompts, say_interrupted
from fastforward.errors import FastForwardError
from fastforward.serving.engines import connect, folders, messages, send

HINT = (
    "fastforward generate: decoding in process; `fastforward engine start` (with this command's --model and "
    "precision flags) keeps a warm engine that answers at once (--no-engine: no engine, no hint)"
)


def answer(argv: list[str]) -> int | None:
    """`generate argv` answered by a running engine: its exit status; None when no engine takes it."""
    if any(flag in argv for flag in ("--no-engine", "-h", "--help")):
        return None
    declined = []
    for folder in folders():
        if (folder.state() or {}).get("state") != "ready":
            continue
        sock = connect(folder)
        if sock is None:
            continue
        with sock:
            send(sock, {"op": "generate", "argv": argv, "cwd": os.getcwd()})
            replies = messages(sock)
            first = next(replies, {"decline": "it closed the connection"})
            if "decline" in first:
                declined.append(first["decline"])
                continue
            if first["accept"]["need_prompts"]:
                send(sock, {"prompts": read_prompts()})
            return relay(replies)
    if declined:
        print(f"fastforward generate: decoding in process: {declined[0]}", file=sys.stderr)
    elif sys.stderr.isatty():
        print(HINT, file=sys.stderr)
    return None


def relay(replies: Iterator[dict[str, Any]]) -> int:
    """Print an accepted request's replies as `generate` prints in process: each prompt's text as it
    streams (prompts in order: a later prompt's text waits for the ones before it), then its report."""
    streamed: dict[int, str] = {}
    reports: dict[int, dict[str, Any]] = {}
    current = total = 0
    as_json = False
    try:
        for reply in replies:
            if "error" in reply:
                raise FastForwardError(reply["error"])
            if "done" in reply:
                return 0
            if "started" in reply:
                total, as_json = reply["started"], reply["json"]
            elif "delta" in reply:
                index = reply["prompt"]
                streamed[index] = streamed.get(index, "") + reply["delta"]
                if index == current and not as_json:
                    _write(reply["delta"])
            else:
                reports[reply["prompt"]] = reply
                while current in reports:
                    done = reports.pop(current)
                    print_report(done["record"], done["summary"], done["warning"], as_json, streamed.pop(current, ""))
                    current += 1
                    if not as_json and streamed.get(current):
                        _write(streamed[current])
    except KeyboardInterrupt:  # closing the connection (the caller's `with`) cancels the request in the engine
        if streamed.get(current) and not as_json:
            print(flush=True)
        say_interrupted(current, total)
        raise
    raise FastForwardError("the engine closed the connection before it answered; see `fastforward engine status`")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
