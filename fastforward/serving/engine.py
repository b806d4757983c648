"""The serving engine: one worker thread decodes batches of requests that share a decoder setting.

A request becomes a `Job` (token ids, a built decoder, its budget, stop strings). The worker takes
the oldest waiting job and every other waiting job with the same decoder setting and budget (up to
`max_batch_size`), and decodes them together in one session (left-padded, as `--batch-size` does;
a decoder that lays rows out one by one, `rows_apart`, gets one session per job). After every step
the session's `on_step` hook turns each row's newly committed tokens into text deltas, cuts the
text before a stop string (and cancels that row), cancels the rows whose clients left, and hands
the deltas to the jobs' event queues, which the HTTP layer reads (`fastforward.serving.app`).

A failure inside decoding fails only the jobs of that batch; the worker goes on with the next.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from fastforward.decoding.decoders import Decoder
from fastforward.decoding.runtime import Session
from fastforward.model import Model
from fastforward.serving.metrics import Metrics

_ids = itertools.count()


@dataclass
class Event:
    """What a job hears: a text delta, or the end (with a finish reason, usage and stats, or an error)."""

    delta: str = ""
    finish_reason: str | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None


@dataclass(eq=False)  # a job is itself: queue membership is by identity
class Job:
    prompt: list[int]
    decoder: Decoder
    setting: str  # decoders with equal settings can share a batch
    max_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    created: float = field(default_factory=time.perf_counter)
    text: str = ""  # sent so far (never past a stop string)
    done: bool = False

    def send(self, event: Event) -> None:
        """Thread-safe: deliver an event to the HTTP side."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """A queue of jobs and the worker thread that decodes them (see the module docstring)."""

    def __init__(self, model: Model, max_batch_size: int = 8, metrics: Metrics | None = None):
        self.model = model
        self.max_batch_size = max_batch_size
        self.metrics = metrics or Metrics()
        self._waiting: deque[Job] = deque()
        self._lock = threading.Condition()
        self._stopping = False
        self._worker = threading.Thread(target=self._run, name="fastforward-engine", daemon=True)
        self._worker.start()

    # ---- the HTTP side ----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        """The client left: drop the job if it waits, else its row is cancelled at the next step."""
        job.cancelled = True
        self.metrics.cancelled.inc()
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.queue_depth.set(len(self._waiting))

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, let the worker finish the batch in flight, fail the jobs still waiting."""
        with self._lock:
            self._stopping = True
            left = list(self._waiting)
            self._waiting.clear()
            self._lock.notify()
        for job in left:
            job.send(Event(finish_reason="error", error="the server shut down before this request started"))
        self._worker.join(timeout)

    # ---- the worker -------------------------------------------------------------------------------
    def _next_batch(self) -> list[Job] | None:
        with self._lock:
            while not self._waiting and not self._stopping:
                self._lock.wait()
            if not self._waiting:
                return None
            first = self._waiting.popleft()
            batch = [first]
            if not first.decoder.rows_apart:
                for job in list(self._waiting):
                    if len(batch) >= self.max_batch_size:
                        break
                    if job.setting == first.setting and job.max_tokens == first.max_tokens:
                        self._waiting.remove(job)
                        batch.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            self.metrics.batch_size.set(len(batch))
            try:
                with torch.inference_mode():
                    self._decode(batch)
            except Exception as exc:  # one batch fails; the server goes on
                for job in batch:
                    if not job.done:
                        job.done = True
                        job.send(Event(finish_reason="error", error=f"decoding failed: {type(exc).__name__}: {exc}"))
                self.metrics.failures.inc(len(batch))

    def _decode(self, batch: list[Job]) -> None:
        decoder = batch[0].decoder
        session = decoder.open_session(self.model, [job.prompt for job in batch], batch[0].max_tokens)
        sent = [0] * len(batch)  # tokens turned into text per row

        def on_step(s: Session) -> None:
            lengths = s.lengths  # committed leading tokens per row; their ids are read only on growth
            for row, job in enumerate(batch):
                if job.done:
                    continue
                if job.cancelled:
                    s.cancel(row)
                    job.done = True
                    continue
                if lengths[row] > sent[row]:
                    ids = s.canvas[row][: lengths[row]]
                    sent[row] = len(ids)
                    self._emit(s, row, job, ids)

        session.on_step = on_step
        decoder.decode(session)
        results = session.results()
        for row, (job, gen) in enumerate(zip(batch, results, strict=True)):
            self.metrics.observe(
                gen.stats.nfe, len(gen.token_ids), time.perf_counter() - job.created, gen.stats.queries
            )
            if job.done:
                continue
            self._emit(session, row, job, gen.token_ids, final=True)
            if not job.done:
                job.done = True
                reason = "stop" if gen.finish_reason == "stop" else "length"
                job.send(
                    Event(finish_reason=reason, usage=self._usage(job, gen.token_ids, gen.stats.nfe, gen.stats.queries))
                )

    def _emit(self, session: Session, row: int, job: Job, ids: list[int], final: bool = False) -> None:
        """Send the text the row's tokens add; at a stop string, cut there, end the job and cancel the row.
        Until `final`, text ending in a partial multi-byte character waits for the tokens that complete it."""
        text = self.model.decode(ids)
        cut = min((i for i in (text.find(s) for s in job.stop if s) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        elif text.endswith("\ufffd") and not final:
            return
        if text.startswith(job.text) and len(text) > len(job.text):
            job.send(Event(delta=text[len(job.text) :]))
            job.text = text
        if cut >= 0:
            session.cancel(row)
            job.done = True
            job.send(
                Event(finish_reason="stop", usage=self._usage(job, ids, session.forwards[row], session.queries[row]))
            )

    @staticmethod
    def _usage(job: Job, ids: list[int], nfe: int, queries: int) -> dict[str, Any]:
        return {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(job.prompt) + len(ids),
            "nfe": nfe,
            "tpf": round(len(ids) / nfe, 4) if nfe else 0.0,
            "queries": queries,  # tokens the decoding forwards ran, drafts included (`runtime.Stats`)
        }


WARM_UP_TEXT = "one two three, one two three, one two three, one two three"  # repeats: drafting decoders draft


def warm_up(model: Model, decoder: Decoder) -> float:
    """Decode a short prompt alone and in a batch of two, so the graphs a server needs are compiled
    before its first request; returns the seconds it took."""
    started = time.perf_counter()
    prompt = model.encode_prompt(WARM_UP_TEXT)
    for batch in ([prompt], [prompt, prompt[1:]]):
        decoder.generate(model, batch, max_new_tokens=24)
    return time.perf_counter() - started
