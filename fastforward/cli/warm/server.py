"""The warm engine process (`fastforward engine run`, what `fastforward engine start` starts): one
model loaded, its steps compiled, answering `generate`'s clients on its folder's socket as `generate`
would in their own process (messages: `fastforward.cli.warm.protocol`).

A request is typed (`Request`): it names what it asks the engine to serve, checked against what the
engine serves, and `generate`'s decoding and output flags, parsed by the client from `generate`'s own
flags (which the engine publishes in its state: `fastforward.cli.warm.flags`). The engine chooses the
decoder as `generate` does (`--decoder`, else the model's decoding.json read at that request, else
generate's default), encodes the prompts as `generate` encodes them and decodes them `--batch-size` at
a time as jobs of the serving `Engine` (rows of its sessions, so they equal a decode alone); each
prompt's report (JSON record, figures line, warning) is built by `generate`'s own functions. A client
that leaves (Ctrl-C) has its jobs cancelled.
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
from fastforward.cli import DEFAULT_DECODER, device_defaults, precision
from fastforward.cli import generate as generate_command
from fastforward.cli.decoding import chosen_decoder, default_decoder
from fastforward.cli.generate import record, summary, warning
from fastforward.cli.generate_io import NO_PROMPTS
from fastforward.cli.warm.flags import GenerateFlags
from fastforward.cli.warm.folder import EngineFolder
from fastforward.cli.warm.protocol import Request
from fastforward.cli.warm.spec import Serves
from fastforward.decoding.decoders import registry
from fastforward.decoding.model_defaults import model_decoding_defaults
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.serving.engine import Engine, Job
from fastforward.serving.warm_up import load_ready


class _ClientLeft(Exception):
    """The client closed its connection (Ctrl-C) before its prompts were decoded."""


def generate_flags() -> GenerateFlags:
    """`generate`'s flags as the engine publishes them to its clients."""
    parser = argparse.ArgumentParser().add_subparsers()
    generate_command.register(parser)
    own = parser.choices["generate"]
    return GenerateFlags.of(own, tuple(registry.all_knobs()), device_defaults(own.get_default("cpu_precision")))


class LocalServer:
    """The model, its `Engine`, and the socket's request handler."""

    def __init__(self, model: Model, serving: Serves, compiled: bool):
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
            message = json.loads(await reader.readline() or "{}")
            if message.get("op") == "ping":
                await _write(writer, self.status())
            elif message.get("op") == "generate":
                self.requests += 1
                try:
                    await self.answer(message.get("request"), reader, writer)
                finally:
                    self.requests -= 1
        except (ConnectionError, ValueError):  # a client gone, or one that speaks no JSON
            pass
        except _ClientLeft:
            print("fastforward engine: a client left (Ctrl-C): its request is cancelled", flush=True)
        finally:
            writer.close()

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "serves": self.serving.as_json(),
            "compiled": self.compiled,
            "requests": self.requests,
        }

    async def answer(self, data: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = Request.from_json(data)
        except (TypeError, ValueError) as exc:
            await _write(writer, {"decline": str(exc)})
            return
        if request.serves != self.serving:
            why = f"the engine serves {self.serving.describe()}, not {request.serves.describe()}"
            await _write(writer, {"decline": why})
            return
        await _write(writer, {"accepted": True})
        try:
            name, decoder, encoded = self.prepare(request)
        except FastForwardError as exc:
            await _write(writer, {"error": str(exc)})
            return
        left = asyncio.ensure_future(reader.read())  # the client sends nothing more: this ends when it leaves
        loop = asyncio.get_running_loop()
        try:
            for start in range(0, len(encoded), request.batch_size):
                batch = encoded[start : start + request.batch_size]
                jobs = [Job(ids, decoder, request.max_new_tokens, list(request.stop), loop) for ids in batch]
                relays = [self.relay(start + i, job, writer, name, request) for i, job in enumerate(jobs)]
                if not await self.decode(jobs, relays, left, writer):
                    return
            await _write(writer, {"done": True})
        finally:
            left.cancel()

    def prepare(self, request: Request) -> tuple[str, Any, list[list[int]]]:
        """The decoder the client's own process would choose (its name and itself), and the prompts
        encoded; what `generate` would fail with raises, in its order."""
        asked = argparse.Namespace(decoder=request.decoder, model=self.serving.model, adapter=self.serving.adapter)
        name, knobs = chosen_decoder(asked, dict(request.options), DEFAULT_DECODER)
        decoder = build_decoder(name, **knobs)
        if not request.prompts:
            raise FastForwardError(NO_PROMPTS)
        if registry.spec(name).needs_mask:
            self.model.require_mask_token(name)
        encoded = [self.model.encode_prompt(p, chat_template=request.chat_template) for p in request.prompts]
        return name, decoder, encoded

    async def decode(self, jobs: list[Job], relays: list, left: asyncio.Future, writer: asyncio.StreamWriter) -> bool:
        """Run a batch's jobs, relaying their events; False when it ended early (an error, or the client
        left: then its jobs are cancelled)."""
        assert self.engine is not None
        try:
            for job in jobs:
                self.engine.submit(job)
        except RuntimeError as exc:  # its queue full, or shutting down
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

    async def relay(self, index: int, job: Job, writer: asyncio.StreamWriter, decoder: str, request: Request) -> bool:
        """One prompt's report to the client, once its row ends. False on a decoding error."""
        while True:
            event = await job.events.get()
            if event.error is not None:
                await _write(writer, {"error": event.error})
                return False
            if event.finish_reason is not None:
                gen = event.generation
                assert gen is not None  # a job that ends without an error ends with its generation
                report = {"record": record(request.prompts[index], decoder, gen), "summary": summary(decoder, gen)}
                await _write(writer, {"prompt": index, **report, "warning": warning(gen, request.max_new_tokens)})
                return True


async def _write(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


class _Stopped(Exception):
    """SIGTERM or SIGINT while the model loads or its steps compile."""


def _stop_loading(signum: int, frame: Any) -> None:
    raise _Stopped


def run(args: argparse.Namespace) -> int:
    """The engine in this process (`engine run`'s flags, resolved), until SIGTERM or SIGINT; its folder
    holds its lock, state and socket."""
    serving = Serves.of(args, os.getcwd())
    folder = EngineFolder.of(serving)
    lock = folder.claim()
    os.umask(0o077)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_loading)
    state = {
        "pid": os.getpid(),
        "serves": serving.as_json(),
        "flags": generate_flags().as_json(),
        "log": str(folder.log),
        "started": time.time(),
    }
    try:
        folder.write_state({**state, "state": "loading"})
        print(f"fastforward engine: loading {serving.describe()} (pid {os.getpid()})", flush=True)
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
