"""`fastforward generate` as the client of a warm engine (`fastforward engine start`): it parses its
command line as `generate` does (`fastforward.cli.warm.flags`), computes the key of the engine that serves
it (`Serves.key`), and sends that one engine a typed request; it prints the engine's reports exactly as
`generate` prints in process, each prompt's once it is complete. It imports neither torch nor
transformers (the seconds a one-shot `generate` spends before its first token).

Without an engine that serves the command line, `generate` decodes in process (`answer` returns None).
An engine that dies before or while it answers (its connection refused, closed, or cut short; no
answer within ACCEPT_SECONDS) is left behind: `generate` decodes in process what it had not printed
yet (`Resume`), so that its output is what `--no-engine` prints, and a dead engine's folder is cleaned.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastforward.cli.generate_io import print_report, read_prompts, say_interrupted
from fastforward.cli.warm.flags import GenerateFlags
from fastforward.cli.warm.folder import EngineFolder, connect, folders
from fastforward.cli.warm.protocol import Request, messages, send
from fastforward.cli.warm.spec import Serves
from fastforward.errors import FastForwardError

HINT = (
    "fastforward generate: decoding in process; `fastforward engine start` (with this command's --model and "
    "precision flags) keeps a warm engine that answers at once (--no-engine: no engine, no hint)"
)
ACCEPT_SECONDS = 30.0  # for an engine to take a request (it answers while it decodes others)
DEAD_SECONDS = 2.0  # for a dead engine's lock to be released, once its connection is


@dataclass(frozen=True)
class Resume:
    """What the in-process `generate` takes over from an engine that died or declined the request: the
    prompts (read from stdin already, where the command line gave none) and how many of them were printed."""

    prompts: list[str]
    printed: int


class _Gone(Exception):
    """The engine stopped answering (how: the message's text)."""


class _Declined(Exception):
    """The engine left the request to the client's process (why: the message's text)."""


@dataclass(frozen=True)
class Chosen:
    """The engine that serves a command line, and the command line as `generate` parses it."""

    folder: EngineFolder
    pid: int
    args: argparse.Namespace
    serves: Serves
    flags: GenerateFlags


def choose(argv: list[str], cwd: str) -> Chosen | str | None:
    """The ready engine that serves `generate argv`; else why none (None: say nothing, as with
    --no-engine, --help or a command line that does not parse: the process's argparse then says why)."""
    if argv[:1] != ["generate"]:
        return None
    # An engine of an older fastforward publishes no flags, and speaks another protocol: it is passed by.
    ready = [(f, s) for f in folders() if (s := f.state() or {}).get("state") == "ready" and "flags" in s]
    if not ready:
        quiet = any(flag in argv for flag in ("--no-engine", "-h", "--help")) or not sys.stderr.isatty()
        return None if quiet else HINT
    asked = None
    for folder, state in ready:
        flags = GenerateFlags.from_json(state["flags"])
        try:
            args = flags.parse(argv[1:])
        except ValueError:
            return None
        if args.no_engine or getattr(args, "help", False):
            return None
        asked = Serves.of(args, cwd)
        if asked.key == folder.key:
            return Chosen(folder, state["pid"], args, asked, flags)
    assert asked is not None
    running = "`fastforward engine status` says which run"
    return f"fastforward generate: decoding in process: no engine serves {asked.describe()} ({running})"


def answer(argv: list[str]) -> int | Resume | None:
    """`fastforward ARGV` (a `generate`) answered by the engine that serves it: its exit status; None when
    none serves it, a `Resume` when it died before it answered all."""
    chosen = choose(argv, os.getcwd())
    if not isinstance(chosen, Chosen):
        if chosen:
            print(chosen, file=sys.stderr)
        return None
    args = chosen.args
    request = Request(
        serves=chosen.serves,
        prompts=tuple(args.prompts or read_prompts()),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        decoder=args.decoder,
        options=chosen.flags.options(args),
        chat_template=not args.no_chat_template,
        json=args.json,
        stop=tuple(args.stop),
    )
    printed = Printed(request)
    try:
        return relay(chosen.folder, request, printed)
    except _Declined as why:
        print(f"fastforward generate: decoding in process: the engine declined the request ({why})", file=sys.stderr)
        return Resume(list(request.prompts), 0)
    except _Gone as gone:
        print(f"fastforward generate: the engine (pid {chosen.pid}) {gone}; decoding in process", file=sys.stderr)
        _clean_if_dead(chosen.folder)
        return Resume(list(request.prompts), printed.count)


class Printed:
    """A request's reports, printed in prompt order as they come (a later prompt's waits for the ones before it)."""

    def __init__(self, request: Request):
        self.request, self.count = request, 0
        self.waiting: dict[int, dict[str, Any]] = {}

    def add(self, reply: dict[str, Any]) -> None:
        self.waiting[reply["prompt"]] = reply
        while self.count in self.waiting:
            done = self.waiting.pop(self.count)
            print_report(done["record"], done["summary"], done["warning"], self.request.json)
            self.count += 1


def relay(folder: EngineFolder, request: Request, printed: Printed) -> int:
    """Send the request and print its reports; raises `_Gone` when the engine stops answering."""
    sock = connect(folder, ACCEPT_SECONDS)
    if sock is None:
        raise _Gone("refused the connection")
    with sock:
        replies = _replies(sock, request)
        first = next(replies, {})
        if "decline" in first:
            raise _Declined(first["decline"])
        if "accepted" in first:
            sock.settimeout(None)  # decoding takes as long as it takes
            try:
                for reply in replies:
                    if "error" in reply:
                        raise FastForwardError(reply["error"])
                    if "done" in reply:
                        return 0
                    printed.add(reply)
            except KeyboardInterrupt:  # closing the connection (the `with`) cancels the request in the engine
                say_interrupted(printed.count, len(request.prompts))
                raise
    raise _Gone("closed the connection before it answered")


def _replies(sock: socket.socket, request: Request) -> Iterator[dict[str, Any]]:
    """The engine's replies to `request`, until it closes the connection; `_Gone` when the connection
    fails or brings a line cut short."""
    try:
        send(sock, {"op": "generate", "request": request.as_json()})
        yield from messages(sock)
    except (OSError, ValueError) as exc:  # a timeout is an OSError too
        raise _Gone(f"stopped answering ({exc or type(exc).__name__})") from exc


def _clean_if_dead(folder: EngineFolder) -> None:
    """Clean a dead engine's folder, waiting the moment its lock takes to be released; a live one stays."""
    deadline = time.monotonic() + DEAD_SECONDS
    while folder.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
