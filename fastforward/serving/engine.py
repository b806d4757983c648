"""The serving engine: a worker thread that drives the engine core (`fastforward.decoding.engine_core`)
and delivers its outputs to the HTTP side's event loops.

A request is a `Job`: the core's `Request` with the event loop and queue its client reads. The core
schedules, steps and postprocesses (batches by decoder setting, stop strings, text increments, finished
rows leaving at the step they finish); the worker's loop adds only what an async server needs: jobs
handed over from the HTTP threads (`submit`, `cancel`: the core's `abort`), other model work run between
two steps (`call`), the metrics, a bounded queue (`QueueFull`: HTTP 503 with Retry-After), and each
step's outputs turned into `Event`s, delivered in one wake-up per event loop per step. Isolated
failures: a failure inside decoding fails only the jobs of that batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from fastforward.decoding import metrics, scheduler
from fastforward.decoding.engine_core import EngineCore, Output, Request
from fastforward.decoding.runtime import PREFILL_TOKENS, Generation
from fastforward.model import Model
from fastforward.serving.metrics import Metrics


@dataclass
class Event:
    """What a job hears: a text delta, or the end (with a finish reason, usage and stats, or an error,
    and the completion's token ids, which log-probabilities are scored on). generation: a row that ran
    to its end gives its whole `Generation` too, which the local engine's client prints as `fastforward
    generate` does (its own finish reason and stats)."""

    delta: str = ""
    finish_reason: str | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None
    token_ids: list[int] | None = None
    generation: Generation | None = None


@dataclass(eq=False)  # a job is itself: queue membership is by identity
class Job(Request):
    """A request of an HTTP client: the core's `Request`, with the event loop and queue its client reads."""

    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def send(self, event: Event) -> None:
        """Thread-safe: deliver an event to the HTTP side."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _deliver(items: list[tuple[Job, Event]]) -> None:
    """On a job's event loop: put each event in its job's queue."""
    for job, event in items:
        job.events.put_nowait(event)


class QueueFull(RuntimeError):
    """The engine holds `max_queue` waiting jobs already: the request should be retried later."""


class Engine:
    """The worker thread driving the engine core, and the queue the HTTP side hands jobs over in (see the
    module docstring)."""

    def __init__(
        self,
        model: Model,
        max_batch_size: int = 8,
        metrics: Metrics | None = None,
        max_batch_tokens: int | None = None,
        max_queue: int = 256,
        max_step_tokens: int | None = None,
        max_prefill_tokens: int = PREFILL_TOKENS,
    ):
        self.model = model
        limits = scheduler.Limits(max_batch_size, max_batch_tokens, max_prefill_tokens)
        # finished rows leave at a quarter of a batch: measured faster than at once for a server (engine_core)
        self.core = EngineCore(model, limits, max_step_tokens, isolate_failures=True, leave_share=0.25)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._inbox: list[Job] = []  # jobs submitted since the worker last took them into the core
        self._calls: list[tuple[Callable[[], Any], Future]] = []  # work to run between two steps (`call`)
        self._lock = threading.Condition()
        self._stopping = False
        self._worker = threading.Thread(target=self._run, name="fastforward-engine", daemon=True)
        self._worker.start()

    # ---- the HTTP side ----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            waiting = len(self._inbox) + len(self.core.waiting)
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting already")
            self._inbox.append(job)
            self.metrics.queue_depth.set(waiting + 1)
            self._lock.notify()

    def call(self, work: Callable[[], Any]) -> Future:
        """Run `work` on the worker between two steps; its result (or error) comes in the Future. Model
        forwards outside decoding (scoring log-probabilities) so take turns with the steps instead of
        racing them for the cores."""
        future: Future = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._calls.append((work, future))
            self._lock.notify()
        return future

    def cancel(self, job: Job) -> None:
        """The client left: the core drops the job if it waits, else ends its row after the next step."""
        EngineCore.abort(job)
        self.metrics.cancelled.inc()
        with self._lock:
            if job in self._inbox:
                self._inbox.remove(job)

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, let the worker finish the rows in flight, fail the jobs still waiting."""
        with self._lock:
            self._stopping = True
            left, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
            self._lock.notify()
        for _, future in calls:
            future.set_exception(RuntimeError("the server shut down before this request started"))
        for job in left:
            job.send(Event(finish_reason="error", error="the server shut down before this request started"))
        self._worker.join(timeout)

    # ---- the worker -------------------------------------------------------------------------------
    def _run(self) -> None:
        """The worker: take the jobs handed over, run `call`'s work, step the core and deliver its outputs,
        until `stop`; then the jobs the core still had waiting fail."""
        while self._wait():
            with self._lock:
                calls, self._calls = self._calls, []
                jobs, self._inbox = self._inbox, []
            self._run_calls(calls)
            for job in jobs:
                self.core.add_request(job)
            if self._stopping:
                self._refuse_waiting()
            outputs = self.core.step()
            if self.core.last_step_rows:
                self.metrics.step_rows.observe(self.core.last_step_rows)
            self.metrics.batch_size.set(len(self.core.running()))
            self.metrics.queue_depth.set(len(self.core.waiting))
            self._deliver(outputs)

    def _wait(self) -> bool:
        """Wait for work: False once the engine stops with nothing left to do."""
        with self._lock:
            while not (self._inbox or self.core.has_work or self._calls or self._stopping):
                self._lock.wait()
            return bool(self._inbox or self.core.has_work or self._calls)

    def _refuse_waiting(self) -> None:
        """Stopping: the jobs not yet started end with an error; the running ones finish."""
        while self.core.waiting:
            job = self.core.waiting.popleft()
            job.send(Event(finish_reason="error", error="the server shut down before this request started"))

    @staticmethod
    def _run_calls(calls: list[tuple[Callable[[], Any], Future]]) -> None:
        """`call`'s work, each result or error into its Future (a cancelled one is skipped)."""
        for work, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    with torch.inference_mode():
                        future.set_result(work())
                except Exception as exc:  # the caller's to answer
                    future.set_exception(exc)

    def _deliver(self, outputs: list[Output]) -> None:
        """A step's outputs as events, handed to each event loop in one wake-up (with dozens of streaming
        rows, waking the HTTP side per token costs the worker its GIL time). A job whose client left hears
        nothing more."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for output in outputs:
            job: Job = output.request  # type: ignore[assignment]
            if output.error is not None:
                self.metrics.failures.inc()
            elif output.generation is not None and job.row is not None:  # it ran (not cancelled while waiting)
                stats = output.generation.stats
                self.metrics.observe(stats.nfe, stats.tokens, time.perf_counter() - job.created, stats.queries)
            if job.cancelled:
                continue
            assert job.loop is not None
            by_loop.setdefault(job.loop, []).extend((job, event) for event in self._events(output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    @staticmethod
    def _events(output: Output) -> list[Event]:
        """What a job hears of one output: its text delta, and its end (a finish reason, usage, token ids and
        the whole generation; or the error)."""
        events = [Event(delta=output.delta)] if output.delta else []
        if output.error is not None:
            events.append(Event(finish_reason="error", error=output.error))
        elif (generation := output.generation) is not None:
            job: Job = output.request  # type: ignore[assignment]
            reason = "stop" if generation.finish_reason == "stop" else "length"
            stats = generation.stats
            usage = _usage(job, stats.tokens, stats.nfe, stats.queries)
            events.append(
                Event(finish_reason=reason, usage=usage, token_ids=list(generation.token_ids), generation=generation)
            )
        return events


def _usage(job: Job, tokens: int, nfe: int, queries: int) -> dict[str, Any]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": tokens,
        "total_tokens": job.prompt_tokens + tokens,
        "nfe": nfe,
        "tpf": round(metrics.tpf(tokens, nfe), 4),
        "queries": queries,  # tokens the decoding forwards ran, drafts included (`runtime.Stats`)
    }
