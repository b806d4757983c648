"""`fastforward engine start|status|stop`: start an engine as a daemon, say what runs, stop engines.
`status` and `stop` import no torch."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from fastforward.cli.warm.folder import EngineFolder, ask, folders
from fastforward.cli.warm.spec import Serves, model_name
from fastforward.errors import FastForwardError

WAIT_SECONDS = 60.0  # for an engine to take its folder at start, or to exit at stop
POLL_SECONDS = 0.1


def start(args: argparse.Namespace, argv: list[str]) -> int:
    """Start `fastforward engine run ARGV` as a daemon (args: ARGV parsed, its precision resolved)."""
    serving = Serves.of(args, os.getcwd())
    folder = EngineFolder.of(serving)
    if folder.alive():
        pid = (folder.state() or {}).get("pid", "?")
        raise FastForwardError(
            f"an engine for {serving.describe()} runs already (pid {pid}); `fastforward engine stop` stops it"
        )
    command = [sys.executable, "-m", "fastforward", "engine", "run", *(a for a in argv if a != "--wait")]
    with open(os.open(folder.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    if not _until(lambda: process.poll() is not None or (folder.state() or {}).get("pid") == process.pid):
        raise FastForwardError(f"the engine did not start within {WAIT_SECONDS:.0f} s; see {folder.log}")
    if process.poll() is not None:
        raise FastForwardError(f"the engine exited as it started: {_last_line(folder)} (log: {folder.log})")
    print(f"fastforward engine: starting {serving.describe()} (pid {process.pid}); log: {folder.log}")
    if not args.wait:
        print("fastforward engine: `fastforward engine status` says when it is ready")
        return 0
    while (folder.state() or {}).get("state") != "ready":
        if process.poll() is not None:
            raise FastForwardError(f"the engine exited before it was ready: {_last_line(folder)} (log: {folder.log})")
        time.sleep(POLL_SECONDS)
    print("fastforward engine: ready")
    return 0


def status() -> int:
    """Say what runs; 0 once every engine is ready to answer."""
    running = folders()
    if not running:
        print("fastforward engine: none runs; `fastforward engine start --model MODEL` starts one")
        return 1
    ready = 0
    for folder in running:
        state = folder.state() or {}
        answer = ask(folder, {"op": "ping"}) if state.get("state") == "ready" else None
        if answer is None:
            serving = Serves.from_json(state["serves"]).describe()
            print(f"warming up: {serving} (pid {state.get('pid')}); log: {folder.log}")
            continue
        steps = "compiled steps" if answer["compiled"] else "eager steps"
        print(
            f"ready: {Serves.from_json(answer['serves']).describe()} (pid {answer['pid']}, {steps}, "
            f"{answer['requests']} requests in flight); log: {folder.log}"
        )
        ready += 1
    return 0 if ready == len(running) else 1


def stop(model: str | None) -> int:
    """Stop the engines of `model` (None: every engine): SIGTERM, so the rows in flight finish first."""
    name = model_name(model, os.getcwd())
    targets = [f for f in folders() if name is None or (f.state() or {}).get("serves", {}).get("model") == name]
    if not targets:
        print("fastforward engine: none runs" + (f" for {name}" if name else ""))
        return 0
    states = [folder.state() or {} for folder in targets]
    for state in states:
        with contextlib.suppress(KeyError, ProcessLookupError):  # it exited meanwhile
            os.kill(state["pid"], signal.SIGTERM)
    for folder, state in zip(targets, states, strict=True):
        if not _until(lambda f=folder: not f.alive()):
            pid = state.get("pid", "?")
            raise FastForwardError(f"the engine (pid {pid}) did not stop within {WAIT_SECONDS:.0f} s; kill {pid}")
        what = Serves.from_json(state["serves"]).describe() if state else folder.path.name
        print(f"fastforward engine: stopped {what}")
    return 0


def _until(done: Callable[[], bool]) -> bool:
    """Poll `done` until it holds (True) or WAIT_SECONDS pass (False)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _last_line(folder: EngineFolder) -> str:
    lines = folder.log.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(its log is empty)"
