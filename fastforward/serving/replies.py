"""A request's jobs as they answer: each job's events (a client that leaves cancels its jobs), their
texts collected for one JSON response or merged into server-sent events as they come, and the
request's usage over its choices."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from fastforward.decoding import metrics
from fastforward.serving.engine import Engine, Event, Job
from fastforward.serving.schema import error_body


async def events(engine: Engine, job: Job, request: Request) -> AsyncIterator[Event]:
    """The job's events until its end; a client that leaves before it cancels the job."""
    ended = False
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            while event.finish_reason is None and not job.events.empty():  # behind: one chunk for all
                later = job.events.get_nowait()
                event = Event(event.delta + later.delta, later.finish_reason, later.error, later.usage, later.token_ids)
            ended = event.finish_reason is not None
            yield event
            if ended:
                return
    finally:
        if not ended:
            engine.cancel(job)


async def collect(engine: Engine, jobs: list[Job], request: Request) -> list[tuple[str, Event]]:
    """Each job's whole text and its last event."""

    async def one(job: Job) -> tuple[str, Event]:
        text, end = "", Event(finish_reason="length")
        async for event in events(engine, job, request):
            text += event.delta
            if event.finish_reason is not None:
                end = event
        return text, end

    return list(await asyncio.gather(*(one(job) for job in jobs)))


async def sse(
    engine: Engine, jobs: list[Job], request: Request, chat: bool, head: dict[str, Any]
) -> AsyncIterator[str]:
    """Server-sent events of all the jobs' choices (choice i: job i) as they come, each chunk with
    `head` (id, object, created, model); usage in the last chunk of a single choice, else in a final
    chunk of its own without choices (as OpenAI's `include_usage`)."""
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()
    ended: set[int] = set()  # the choices whose end came

    async def pump(index: int, job: Job) -> None:
        async for event in events(engine, job, request):
            if event.finish_reason is not None:
                ended.add(index)
            await queue.put((index, event))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running, started, usages = len(jobs), set(), []
        while running:
            index, event = await queue.get()
            if event is None:
                running -= 1
                continue
            if event.error is not None:
                yield f"data: {json.dumps(error_body(event.error, 'server_error'))}\n\n"
                return
            choice: dict[str, Any] = {"index": index, "finish_reason": event.finish_reason}
            if chat:
                choice["delta"] = {"content": event.delta} if event.delta else {}
                if index not in started:
                    choice["delta"]["role"] = "assistant"
            else:
                choice |= {"text": event.delta, "logprobs": None}
            started.add(index)
            chunk = {**head, "choices": [choice]}
            if event.usage is not None:
                usages.append(event.usage)
                if len(jobs) == 1:
                    chunk["usage"] = event.usage
            yield f"data: {json.dumps(chunk)}\n\n"
        if len(jobs) > 1:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': total(usages, [len(jobs[0].prompt)])})}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client left, or all is sent: no job decodes on for nobody
        for task in tasks:
            task.cancel()
        for index, job in enumerate(jobs):
            if index not in ended:
                engine.cancel(job)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Usage with no decoding figures (the engine's jobs report theirs: `Engine._usage`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "nfe": 0,
        "tpf": 0.0,
        "queries": 0,
    }


def total(usages: list[dict[str, Any] | None], prompts: list[int]) -> dict[str, Any]:
    """One request's usage over its choices: each prompt counted once, the completions added up."""
    usages = [u for u in usages if u]
    if len(usages) == 1 and len(prompts) == 1:
        return usages[0]
    out = usage(sum(prompts), sum(u["completion_tokens"] for u in usages))
    out["nfe"] = sum(u["nfe"] for u in usages)
    out["queries"] = sum(u["queries"] for u in usages)
    out["tpf"] = round(metrics.tpf(out["completion_tokens"], out["nfe"]), 4)
    return out
