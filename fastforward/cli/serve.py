"""`fastforward serve`: an OpenAI-compatible server (completions, chat, streaming) for any decoder."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import socket
from typing import Any

from fastforward.api import build_decoder
from fastforward.cli import (
    DECODING_DEFAULTS,
    add_command,
    add_compile_flag,
    add_precision_flags,
    add_threads_flag,
    positive_int,
    precision,
)
from fastforward.cli.decoding import add_decoder_flags, chosen_decoder, decoder_knobs
from fastforward.decoding.runtime import PREFILL_TOKENS
from fastforward.errors import FastForwardError
from fastforward.model import check_device
from fastforward.serving.limits import MAX_REQUEST_BYTES
from fastforward.serving.warm_up import load_ready

API_KEY_ENV = "FASTFORWARD_API_KEY"
DEFAULT_DECODER = "ar"  # what a model without decoding.json serves, as before models carried their own


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    p.add_argument("--served-name", help="the model id clients send (default: --model)")
    add_decoder_flags(
        p,
        default=None,
        skip=("seed",),
        default_help=f"the model's own, from its decoding.json, else {DEFAULT_DECODER}; a request may name another",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="base of the seeds drawn for requests that send none, so that a restarted server gives the same "
        "sequence of samples (default: a fresh random seed per request, as OpenAI; a request's own seed always "
        "reproduces its output)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s; beyond it, set --api-key)"
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health (401 without it); set it whenever "
        f"--host is not 127.0.0.1 (default: ${API_KEY_ENV}, else none)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=MAX_REQUEST_BYTES,
        help="larger request bodies get 413 before they are read or parsed (default: %(default)s)",
    )
    p.add_argument("--max-batch-size", type=positive_int, default=8, help="requests decoded together (rows)")
    p.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=None,
        help="admit a request while the prompts and budgets of the running ones stay within this (default: no bound)",
    )
    p.add_argument(
        "--max-queue", type=positive_int, default=256, help="waiting requests before new ones get 503 Retry-After"
    )
    p.add_argument(
        "--max-step-tokens",
        type=positive_int,
        default=None,
        help="bound the tokens of one forward over its rows: jacobi, lookup and sbd-verified draft less while many "
        "requests share it (default: 128 on a CPU, no bound on a GPU)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=positive_int,
        default=PREFILL_TOKENS,
        help="prompt tokens that may join the running batch between two steps (at least one request): a burst of "
        "long prompts prefills over several steps, so running requests keep streaming (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        help="budget of a request that gives none, cut to what the context leaves (default: %(default)s)",
    )
    add_precision_flags(p, **DECODING_DEFAULTS)
    # A server lives long: compiled steps pay back their start-up (seconds, once kept) within its first
    # requests (docs/results.md, "CPU speed against llama.cpp").
    add_compile_flag(p, compile=True)
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=None,
        help="run N copies of the server on Ray Serve behind its proxy (pip install 'fastforward[ray]'; a "
        "Ray cluster at RAY_ADDRESS, else a local one)",
    )
    p.add_argument(
        "--cpus-per-replica", type=float, default=None, help="CPUs Ray reserves for each replica (default: Ray's 1)"
    )
    p.add_argument(
        "--warm-up-only",
        action="store_true",
        help="compile (or read back) the steps this server would need, then exit without serving: setup.sh "
        "prepares the defaults so; an image build can prepare its own",
    )
    add_threads_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from fastforward.serving.app import Server

    class GracefulServer(uvicorn.Server):
        """uvicorn's server; SIGTERM / Ctrl-C shut it down gracefully and the command exits with 0
        (uvicorn itself re-raises the signal after its shutdown, which reads as a crash)."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    check_device(args.device)
    name = args.served_name or args.model
    args.decoder, knobs = chosen_decoder(args, serve_knobs(args), DEFAULT_DECODER)
    options = {
        "name": name,
        "decoder": args.decoder,
        "knobs": knobs if args.seed is None else {**knobs, "seed": args.seed},
        "max_batch_size": args.max_batch_size,
        "max_tokens": args.max_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "max_queue": args.max_queue,
        "max_step_tokens": args.max_step_tokens,
        "max_prefill_tokens": args.max_prefill_tokens,
        "api_key": args.api_key or None,
        "max_request_bytes": args.max_request_bytes,
    }
    load = {"name_or_path": args.model, "device": args.device, "precision": precision(args)}
    if args.warm_up_only:  # here, for this machine's store: replicas on it read the same
        if not args.compile:
            raise FastForwardError("--warm-up-only prepares compiled steps: leave out --no-compile")
        load_ready(load, build_decoder(args.decoder, **knobs), "fastforward serve")
        return 0
    if args.replicas:
        from fastforward.serving import replicas

        replicas.require_ray()  # before anything loads
        build_decoder(args.decoder, **knobs)  # bad settings fail here, not in every replica
        build = replicas.app_builder(load, options, compile_warm_up=args.compile)
        replicas.serve_replicas(build, args.replicas, args.host, args.port, args.cpus_per_replica)
        print("fastforward serve: shut down", flush=True)
        return 0
    listening = listen(args.host, args.port)  # before the minutes of loading and warm-up: a taken port fails now
    model = load_ready(load, build_decoder(args.decoder, **knobs) if args.compile else None, "fastforward serve")
    server = Server(model, **options)
    print(f"fastforward serve: {name} with {args.decoder} on http://{args.host}:{args.port}/v1", flush=True)
    config = uvicorn.Config(
        server.app(), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30
    )
    GracefulServer(config).run(sockets=[listening])
    print("fastforward serve: shut down", flush=True)
    return 0


def serve_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The decoder options given on the command line; `--seed` is the server's own (see its help)."""
    return {k: v for k, v in decoder_knobs(args).items() if k != "seed"}


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (uvicorn serves on it), or one line saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = "it is in use; choose another --port" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise FastForwardError(f"cannot listen on {host}:{port}: {why}") from exc
    return sock
