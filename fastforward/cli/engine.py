"""`fastforward engine start|status|stop`: a warm local engine that answers `fastforward generate`.

`start` starts the engine as a daemon for one model and precision (generate's flags and defaults; its
decoding steps compiled, as `serve` compiles them) and returns; `status` says what runs, and exits 0
once every engine is ready to answer; `stop` stops them (SIGTERM: the rows in flight finish first). While
an engine for the same model and precision runs, `generate` is its client: the same output, without the
seconds of importing torch and loading the model. Engines for other models or precisions run beside it.
Their sockets, states and logs live under $FASTFORWARD_HOME/engines (owner-only). The engine, its
client and its folders: `fastforward.cli.warm`.
"""

from __future__ import annotations

import argparse
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
from fastforward.cli.warm import control


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


def _start(args: argparse.Namespace, argv: list[str]) -> int:
    resolve_precision(args)
    return control.start(args, argv)


def _run_engine(args: argparse.Namespace, argv: list[str]) -> int:
    from fastforward.cli.warm import server
    from fastforward.cpu.threads import use_threads

    resolve_precision(args)
    use_threads(args.threads)
    return server.run(args)


ACTIONS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "start": _start,
    "status": lambda args, argv: control.status(),
    "stop": lambda args, argv: control.stop(args.model),
    "run": _run_engine,
}
