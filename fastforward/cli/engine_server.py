"""The warm local engine (`fastforward engine run`, what `fastforward engine start` starts): one model
loaded, its steps compiled, answering `fastforward generate` over a unix socket as `generate` would in
its own process.

A request is `generate`'s own argument list (and the client's working directory): the engine parses it
with `generate`'s parser, so every decoder and option means what it means in process. It declines what
it cannot answer as in process (another model, precision or device, or arguments that do not parse: the
client then decodes in process, where argparse says what is wrong). An accepted request's prompts are
encoded as `generate` encodes them and decoded `--batch-size` at a time, as jobs of the serving `Engine`
(rows of its sessions, so they equal a decode alone: `fastforward.serving.engine`); each prompt's text
deltas stream back as they come, then its `generate` report (JSON record, figures line, warning), built
by `generate`'s own functions. A client that leaves (Ctrl-C) has its jobs cancelled.

Messages, one JSON object a line: client `{"op": "ping"}` → `{"pid", "serves", "compiled", "requests"}`;
client `{"op": "generate", "argv", "cwd"}` → `{"decline": why}` or `{"accept": {"need_prompts"}}`
(then client `{"prompts": [...]}` when it read them from its stdin) → `{"error": message}` or
`{"started": prompts, "json": --json}`, then `{"prompt": i, "delta"}` and `{"prompt": i, "record",
"summary", "warning"}` → `{"done": true}` (or `{"error": message}` when decoding fails).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from typing import Any

from fastforward.api import build_decoder
from fastforward.cli import DEFAULT_DECODER, build_parser, precision, resolve_precision
from fastforward.cli.decoding import chosen_decoder, decoder_knobs, default_decoder
from fastforward.cli.generate import record, summary, warning
from fastforward.cli.generate_io import NO_PROMPTS
from fastforward.decoding.decoders import registry
from fastforward.decoding.model_defaults import model_decoding_defaults
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.serving.engine import Engine, Job, QueueFull
from fastforward.serving.engines import EngineFolder, describe, serves
from fastforward.serving.warm_up import load_ready


class Declined(Exception):
    """A request the engine leaves to the client's own process."""


class _Parser(argparse.ArgumentParser):
    """`generate`'s parser, raising instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise Declined(f"its arguments do not parse here ({message})")


class _ClientLeft(Exception):
    """The client closed its connection (Ctrl-C) before its prompts were decoded."""


class LocalServer:
    """The model, its `Engine`, and the socket's request handler."""

    def __init__(self, model: Model, serving: dict[str, Any], compiled: bool):
        self.model, self.serving, self.compiled = model, serving, compiled
        self.engine: Engine | None = None
        self.requests = 0  # in flight

    async def serve(self, folder: EngineFolder, state: dict[str, Any]) -> None:
        """Answer on the folder's socket until SIGTERM or SIGINT; then finish the rows in flight."""
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        self.engine = Engine(self.model)
        folder.socket.unlink(missing_ok=True)  # a killed predecessor's: this process holds the lock
        server = await asyncio.start_unix_server(self.handle, path=str(folder.socket))
        os.chmod(folder.socket, 0o600)
        folder.write_state({**state, "state": "ready"})
        print(f"fastforward engine: ready on {folder.socket}", flush=True)
        await stopping.wait()
        print("fastforward engine: stopping (the rows in flight finish first)", flush=True)
        server.close()
        folder.socket.unlink(missing_ok=True)
        await asyncio.to_thread(self.engine.stop)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await reader.readline() or "{}")
            if request.get("op") == "ping":
                await _write(writer, self.status())
            elif request.get("op") == "generate":
                self.requests += 1
                try:
                    await self.generate(request, reader, writer)
                finally:
                    self.requests -= 1
        except (ConnectionError, ValueError):  # a client gone, or one that speaks no JSON
            pass
        except _ClientLeft:
            print("fastforward engine: a client left (Ctrl-C): its request is cancelled", flush=True)
        finally:
            writer.close()

    def status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "serves": self.serving, "compiled": self.compiled, "requests": self.requests}

    async def generate(self, request: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            args = self.parse(request["argv"], request["cwd"])
        except Declined as why:
            await _write(writer, {"decline": str(why)})
            return
        await _write(writer, {"accept": {"need_prompts": not args.prompts}})
        prompts = args.prompts or json.loads(await reader.readline())["prompts"]
        try:
            if not prompts:
                raise FastForwardError(NO_PROMPTS)
            # The decoder the client's own process would choose: relative paths lead from its directory.
            name, knobs = chosen_decoder(args, decoder_knobs(args), DEFAULT_DECODER, request["cwd"])
            decoder = build_decoder(name, **knobs)
            if registry.spec(name).needs_mask:
                self.model.require_mask_token(name)
            encoded = [self.model.encode_prompt(p, chat_template=not args.no_chat_template) for p in prompts]
        except FastForwardError as exc:
            await _write(writer, {"error": str(exc)})
            return
        await _write(writer, {"started": len(prompts), "json": args.json})
        left = asyncio.ensure_future(reader.read())  # the client sends nothing more: this ends when it leaves
        loop = asyncio.get_running_loop()
        try:
            for start in range(0, len(encoded), args.batch_size):
                jobs = [
                    Job(ids, decoder, args.max_new_tokens, [], loop) for ids in encoded[start : start + args.batch_size]
                ]
                relays = [
                    self.relay(start + i, prompts[start + i], job, writer, name, args) for i, job in enumerate(jobs)
                ]
                if not await self.decode(jobs, relays, left, writer):
                    return
            await _write(writer, {"done": True})
        finally:
            left.cancel()

    def parse(self, argv: list[str], cwd: str) -> argparse.Namespace:
        """`generate`'s arguments, when this engine answers them as the client's own process would."""
        args = build_parser("generate", parser_class=_Parser).parse_args(argv)
        resolve_precision(args)
        asked = serves(args, cwd)
        if asked != self.serving:
            raise Declined(f"the engine serves {describe(self.serving)}, not {describe(asked)}")
        return args

    async def decode(self, jobs: list[Job], relays: list, left: asyncio.Future, writer: asyncio.StreamWriter) -> bool:
        """Run a batch's jobs, relaying their events; False when it ended early (an error, or the client
        left: then its jobs are cancelled)."""
        assert self.engine is not None
        try:
            for job in jobs:
                self.engine.submit(job)
        except (QueueFull, RuntimeError) as exc:  # full, or shutting down
            for job in jobs:
                self.engine.cancel(job)
            await _write(writer, {"error": f"the engine cannot take the request now: {exc}"})
            return False
        relaying = asyncio.gather(*relays)
        await asyncio.wait([relaying, left], return_when=asyncio.FIRST_COMPLETED)
        if relaying.done() and not relaying.exception():
            return all(relaying.result())
        for job in jobs:
            self.engine.cancel(job)
        relaying.cancel()
        raise _ClientLeft

    async def relay(
        self, index: int, prompt: str, job: Job, writer: asyncio.StreamWriter, decoder: str, args: argparse.Namespace
    ) -> bool:
        """One prompt's events to the client: its text deltas, then its report. False on a decoding error."""
        while True:
            event = await job.events.get()
            if event.error is not None:
                await _write(writer, {"error": event.error})
                return False
            if event.delta:
                await _write(writer, {"prompt": index, "delta": event.delta})
            if event.finish_reason is not None:
                gen = event.generation
                assert gen is not None  # a job without stop strings ends with its row's generation
                report = {"record": record(prompt, decoder, gen), "summary": summary(decoder, gen)}
                await _write(writer, {"prompt": index, **report, "warning": warning(gen, args.max_new_tokens)})
                return True


async def _write(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


class _Stopped(Exception):
    """SIGTERM or SIGINT while the model loads or its steps compile."""


def _stop_loading(signum: int, frame: Any) -> None:
    raise _Stopped


def run(args: argparse.Namespace) -> int:
    """The engine in this process, until SIGTERM or SIGINT; its folder holds its lock, state and socket."""
    serving = serves(args, os.getcwd())
    folder = EngineFolder.of(serving)
    lock = folder.claim()
    os.umask(0o077)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_loading)
    state = {"pid": os.getpid(), "serves": serving, "log": str(folder.log), "started": time.time()}
    try:
        folder.write_state({**state, "state": "loading"})
        print(f"fastforward engine: loading {describe(serving)} (pid {os.getpid()})", flush=True)
        # Warmed up too, with the decoder a `generate` of this model gets by default (the warm-up adds the
        # kinds of step of ar and jacobi): the first forwards of a process are slow (eager steps too), and
        # "ready" promises a quick answer.
        load = {"name_or_path": args.model, "device": args.device, "precision": precision(args)}
        name, knobs = default_decoder({}, model_decoding_defaults(args.model, args.adapter), DEFAULT_DECODER)
        model = load_ready(load, build_decoder(name, **knobs), "fastforward engine")
        asyncio.run(LocalServer(model, serving, args.compile).serve(folder, state))
    except _Stopped:
        print("fastforward engine: stopped before it was ready", flush=True)
    finally:
        folder.clean()
        os.close(lock)
    print("fastforward engine: stopped", flush=True)
    return 0
