"""The server's warm-up: the kinds of step it will run are compiled before its first request."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastforward.cpu.threads import on_passing_thread
from fastforward.decoding.decoders import Decoder, registry
from fastforward.errors import FastForwardError
from fastforward.model import Model, load_model
from fastforward.serving.engine import Engine, Job

WARM_UP_TEXT = "one two three, one two three, one two three, one two three"  # repeats: drafting decoders draft


# Requests may name another decoder than the server's: these make the kinds of step the decoders
# run (one token, a causal block), so that such a request compiles nothing either.
WARM_UP_DECODERS = ("ar", "jacobi")


def warm_up(model: Model, decoder: Decoder) -> float:
    """Serve a short prompt alone, then two (the second joining the first's running batch), through an
    engine as the server's, with the server's decoder and with each of `WARM_UP_DECODERS`: so the kinds
    of step a server runs are compiled before its first request. After it, compiled steps compile no new
    kind: one compiled in the middle of serving would hold every request of the moment for a minute or
    more, so a step of a kind the warm-up did not meet runs eagerly (the same tokens; said once).
    Returns the seconds it took."""
    started = time.perf_counter()
    prompt = model.encode_prompt(WARM_UP_TEXT)
    others = [registry.spec(name).create() for name in WARM_UP_DECODERS if name != decoder.name]

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        engine = Engine(model, max_batch_size=2)

        def submit(each: Decoder, ids: list[int]) -> Job:
            job = Job(ids, each, 24, [], loop)
            engine.submit(job)
            return job

        async def finish(job: Job, first_event_only: bool = False) -> None:
            while (event := await job.events.get()).finish_reason is None and not first_event_only:
                pass
            if event.error:
                raise FastForwardError(f"the server's warm-up failed: {event.error}")

        try:
            for each in [decoder, *others]:
                await finish(submit(each, prompt))
                running = submit(each, prompt)
                await finish(running, first_event_only=True)  # decoding: the next one joins its batch
                joining = submit(each, prompt[1:])
                await finish(running)
                await finish(joining)
        finally:
            await asyncio.to_thread(engine.stop)

    # On a thread of its own: a caller may be inside an event loop already (a Ray Serve replica's builder).
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, serve()).result()
    if model.compiled_forward is not None:  # from now on, what it did not prepare runs eagerly
        model.compiled_forward.compile_new_kinds = False
    return time.perf_counter() - started


def load_ready(load: dict[str, Any], decoder: Decoder | None, who: str | None = None) -> Model:
    """`load_model(**load)`, warmed up with `decoder` (None: not warmed), both on a thread that ends
    (`on_passing_thread`): the engine's thread that decodes next is then the only one with OpenMP
    workers, and runs at full speed. `who` names the program in the two lines said about the warm-up
    (None: nothing said, as a Ray Serve replica)."""

    def loaded() -> Model:
        model = load_model(**load)
        if decoder is None:
            return model
        if who is not None:
            compiling = " (compiling its steps: minutes at a model's first start, read back later; --no-compile: none)"
            print(f"{who}: warming up{compiling if model.compiled_forward is not None else ''}", flush=True)
        seconds = warm_up(model, decoder)
        if who is not None:
            print(f"{who}: warmed up in {seconds:.0f} s", flush=True)
        return model

    return on_passing_thread(loaded)
