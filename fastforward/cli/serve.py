"""`fastforward serve`: an OpenAI-compatible server (completions, chat, streaming) for any decoder."""

from __future__ import annotations

import argparse
import contextlib
import signal

from fastforward.api import build_decoder
from fastforward.cli import (
    add_command,
    add_compile_flag,
    add_precision_flags,
    add_threads_flag,
    positive_int,
    precision,
)
from fastforward.cli.decoding import add_decoder_flags, decoder_knobs
from fastforward.decoding.runtime import PREFILL_TOKENS
from fastforward.errors import FastForwardError
from fastforward.model import Model, check_device, load_model
from fastforward.serving.engine import warm_up


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    p.add_argument("--served-name", help="the model id clients send (default: --model)")
    add_decoder_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
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
        "--static-batches",
        action="store_true",
        help="no continuous batching: a batch of requests with equal settings and budgets decodes to its end",
    )
    p.add_argument("--max-tokens", type=positive_int, default=256, help="budget of a request that gives none")
    add_precision_flags(p, dtype="float32", quantize="int4", exact=True)
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
    options = {
        "name": name,
        "decoder": args.decoder,
        "knobs": decoder_knobs(args),
        "max_batch_size": args.max_batch_size,
        "max_tokens": args.max_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "max_queue": args.max_queue,
        "continuous": not args.static_batches,
        "max_step_tokens": args.max_step_tokens,
        "max_prefill_tokens": args.max_prefill_tokens,
    }
    if args.warm_up_only:  # here, for this machine's store: replicas on it read the same
        if not args.compile:
            raise FastForwardError("--warm-up-only prepares compiled steps: leave out --no-compile")
        _warm_up(load_model(args.model, device=args.device, **precision(args)), args)
        return 0
    if args.replicas:
        from fastforward.serving import replicas

        replicas.require_ray()  # before anything loads
        build_decoder(args.decoder, **decoder_knobs(args))  # bad settings fail here, not in every replica
        load = {"name_or_path": args.model, "device": args.device, **precision(args)}
        build = replicas.app_builder(load, options, compile_warm_up=args.compile)
        replicas.serve_replicas(build, args.replicas, args.host, args.port, args.cpus_per_replica)
        print("fastforward serve: shut down", flush=True)
        return 0
    model = load_model(args.model, device=args.device, **precision(args))
    if args.compile:
        _warm_up(model, args)
    server = Server(model, **options)
    print(f"fastforward serve: {name} with {args.decoder} on http://{args.host}:{args.port}/v1", flush=True)
    config = uvicorn.Config(
        server.app(), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30
    )
    GracefulServer(config).run()
    print("fastforward serve: shut down", flush=True)
    return 0


def _warm_up(model: Model, args: argparse.Namespace) -> None:
    print(
        "fastforward serve: preparing the compiled decoding steps (a model's first start compiles them, "
        "minutes on a small CPU; later starts read them back; --no-compile: eager steps)...",
        flush=True,
    )
    seconds = warm_up(model, build_decoder(args.decoder, **decoder_knobs(args)))
    print(f"fastforward serve: compiled in {seconds:.0f} s", flush=True)
