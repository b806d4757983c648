"""`fastforward engine start|status|stop`: a warm local engine that answers `fastforward generate`.

`start` starts the engine as a daemon for one model and precision (generate's flags and defaults; its
decoding steps compiled, as `serve` compiles them) and returns; `status` says what runs, and exits 0
once every engine is ready to answer; `stop` stops them (SIGTERM: the rows in flight finish first). While
an engine for the same model and precision runs, `generate` is its client: the same output, without the
seconds of importing torch and loading the model. Engines for other models or precisions run beside it.
Their sockets, states and logs live under $FASTFORWARD_HOME/engines (owner-only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from fastforward.cli import (
    DECODING_DEFAULTS,
    DefaultsShown,
    add_command,
    add_compile_flag,
    add_precision_flags,
    add_threads_flag,
    resolve_precision,
)
from fastforward.errors import FastForwardError
from fastforward.serving.engines import EngineFolder, ask, describe, folders, model_name, serves

WAIT_SECONDS = 60.0  # for an engine to take its folder at start, or to exit at stop
POLL_SECONDS = 0.1


def register(sub: argparse._SubParsersAction) -> None:
    # The actions' options are parsed by `action_parser`: `status` and `stop` never import torch.
    p = add_command(sub, "engine", description=__doc__)
    p.add_argument(
        "action",
        choices=list(ACTIONS),
        help="start, status or stop; run: the engine in this process (what start starts)",
    )
    p.add_argument(
        "options", nargs=argparse.REMAINDER, help="the action's options (`fastforward engine ACTION --help`)"
    )
    p.set_defaults(run=run)


def action_parser(action: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"fastforward engine {action}", formatter_class=DefaultsShown)
    if action in ("start", "run"):
        p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
        add_precision_flags(p, **DECODING_DEFAULTS)  # generate's: a generate of the same flags uses the engine
        add_compile_flag(p, compile=True)  # a warm engine lives long enough to pay its compile back, as serve
        p.add_argument("--device", default=None, help="torch device (default: cpu)")
        add_threads_flag(p)
        p.set_defaults(command=f"engine {action}")
    if action == "start":
        p.add_argument("--wait", action="store_true", help="return once the engine is ready to answer")
    if action == "stop":
        p.add_argument("--model", default=None, help="stop only the engines of this model (default: every engine)")
    return p


def run(args: argparse.Namespace) -> int:
    options = action_parser(args.action).parse_args(args.options)
    return ACTIONS[args.action](options, args.options)


def start(args: argparse.Namespace, argv: list[str]) -> int:
    resolve_precision(args)
    serving = serves(args, os.getcwd())
    folder = EngineFolder.of(serving)
    if folder.alive():
        pid = (folder.state() or {}).get("pid", "?")
        raise FastForwardError(
            f"an engine for {describe(serving)} runs already (pid {pid}); `fastforward engine stop` stops it"
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
    print(f"fastforward engine: starting {describe(serving)} (pid {process.pid}); log: {folder.log}")
    if not args.wait:
        print("fastforward engine: `fastforward engine status` says when it is ready")
        return 0
    while (folder.state() or {}).get("state") != "ready":
        if process.poll() is not None:
            raise FastForwardError(f"the engine exited before it was ready: {_last_line(folder)} (log: {folder.log})")
        time.sleep(POLL_SECONDS)
    print("fastforward engine: ready")
    return 0


def status(args: argparse.Namespace, argv: list[str]) -> int:
    running = folders()
    if not running:
        print("fastforward engine: none runs; `fastforward engine start --model MODEL` starts one")
        return 1
    ready = 0
    for folder in running:
        state = folder.state() or {}
        answer = ask(folder, {"op": "ping"}) if state.get("state") == "ready" else None
        if answer is None:
            print(f"warming up: {describe(state['serves'])} (pid {state.get('pid')}); log: {folder.log}")
            continue
        steps = "compiled steps" if answer["compiled"] else "eager steps"
        print(
            f"ready: {describe(answer['serves'])} (pid {answer['pid']}, {steps}, {answer['requests']} requests "
            f"in flight); log: {folder.log}"
        )
        ready += 1
    return 0 if ready == len(running) else 1


def stop(args: argparse.Namespace, argv: list[str]) -> int:
    model = model_name(args.model, os.getcwd())
    targets = [f for f in folders() if model is None or (f.state() or {}).get("serves", {}).get("model") == model]
    if not targets:
        print("fastforward engine: none runs" + (f" for {model}" if model else ""))
        return 0
    states = [folder.state() or {} for folder in targets]
    for state in states:
        with contextlib.suppress(KeyError, ProcessLookupError):  # it exited meanwhile
            os.kill(state["pid"], signal.SIGTERM)
    for folder, state in zip(targets, states, strict=True):
        if not _until(lambda f=folder: not f.alive()):
            pid = state.get("pid", "?")
            raise FastForwardError(f"the engine (pid {pid}) did not stop within {WAIT_SECONDS:.0f} s; kill {pid}")
        print(f"fastforward engine: stopped {describe(state['serves']) if state else folder.path.name}")
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


def _run_engine(args: argparse.Namespace, argv: list[str]) -> int:
    from fastforward.cli import engine_server
    from fastforward.cpu.threads import use_threads

    resolve_precision(args)
    use_threads(args.threads)
    return engine_server.run(args)


ACTIONS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "start": start,
    "status": status,
    "stop": stop,
    "run": _run_engine,
}
