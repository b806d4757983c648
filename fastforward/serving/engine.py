"""The serving engine: one worker thread decodes batches of requests that share a decoder setting.

A request becomes a `Job` (token ids, a built decoder, its budget, stop strings, its sampling seed).
The worker takes the oldest waiting job and every other waiting job with the same decoder setting
and budget (up to `max_batch_size`), and decodes them together in one session (left-padded, as
`--batch-size` does; a decoder that lays rows out one by one, `rows_apart`, gets one session per
job). Each row samples with its own request's seed (`Prompt.seed`), so requests that differ only in
their seed share a batch and each gets the tokens it would get alone. After every step the
session's `on_step` hook turns each row's newly committed tokens into text deltas (`TextStream`:
incremental, so a long stream costs no more per step than a short one), cuts the text before a stop
string (and cancels that row), cancels the rows whose clients left, and hands the deltas to the
jobs' event queues, which the HTTP layer reads (`fastforward.serving.app`).

A failure inside decoding fails only the jobs of that batch; the worker goes on with the next.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fastforward.decoding.decoders import Decoder
from fastforward.decoding.runtime import Prompt, Session
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
    seed: int | None = None  # the request's own sampling seed (None: the decoder's)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    created: float = field(default_factory=time.perf_counter)
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
        rows = [Prompt(job.prompt, seed=job.seed) for job in batch]
        session = decoder.open_session(self.model, rows, batch[0].max_tokens)
        streams = [TextStream(self.model.decode, job.stop) for job in batch]
        sent = [0] * len(batch)  # tokens handed to each row's text stream

        def on_step(s: Session) -> None:
            lengths = s.lengths  # committed leading tokens per row; only the new ones are read
            for row, job in enumerate(batch):
                if job.done:
                    continue
                if job.cancelled:
                    s.cancel(row)
                    job.done = True
                    continue
                if lengths[row] > sent[row]:
                    ids = s.canvas[row][sent[row] : lengths[row]]
                    sent[row] = lengths[row]
                    self._emit(s, row, job, streams[row].push(ids))

        session.on_step = on_step
        decoder.decode(session)
        results = session.results()
        for row, (job, gen) in enumerate(zip(batch, results, strict=True)):
            self.metrics.observe(
                gen.stats.nfe, len(gen.token_ids), time.perf_counter() - job.created, gen.stats.queries
            )
            if job.done:
                continue
            self._emit(session, row, job, streams[row].push(gen.token_ids[sent[row] :], final=True))
            if not job.done:
                job.done = True
                reason = "stop" if gen.finish_reason == "stop" else "length"
                usage = self._usage(job, len(gen.token_ids), gen.stats.nfe, gen.stats.queries)
                job.send(Event(finish_reason=reason, usage=usage))

    def _emit(self, session: Session, row: int, job: Job, pushed: tuple[str, bool]) -> None:
        """Send a row's new text (`TextStream.push`); after a stop string, end the job and cancel the row."""
        delta, stopped = pushed
        if delta:
            job.send(Event(delta=delta))
        if stopped:
            session.cancel(row)
            job.done = True
            usage = self._usage(job, session.lengths[row], session.forwards[row], session.queries[row])
            job.send(Event(finish_reason="stop", usage=usage))

    @staticmethod
    def _usage(job: Job, tokens: int, nfe: int, queries: int) -> dict[str, Any]:
        return {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": tokens,
            "total_tokens": len(job.prompt) + tokens,
            "nfe": nfe,
            "tpf": round(tokens / nfe, 4) if nfe else 0.0,
            "queries": queries,  # tokens the decoding forwards ran, drafts included (`runtime.Stats`)
        }


class TextStream:
    """A row's text as its tokens arrive: each push returns only the new, complete text, and nothing
    from the first stop string on.

    Incremental, so streaming n tokens costs O(n), not a decode of the whole text per step: a push
    decodes a short window, the tokens not yet out plus those of the piece of text before them (so a
    tokenizer that spaces a word by what precedes it decodes it as in the whole text), and sends what
    the new tokens add. A window whose text ends in U+FFFD (a multi-byte character split across
    tokens) waits for the tokens that complete it, until `final`; byte-level BPE text sent this way
    concatenates to exactly the decode of all the tokens. Text that could begin a stop string waits
    until it does not (or `final`), so the text is cut exactly before the first stop string, even
    one that spans several steps.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.ids: list[int] = []
        self.start = 0  # the window's first token: the piece of text before the tokens not yet out
        self.out = 0  # tokens whose text is out (sent, or held for a stop string)
        self.held = ""  # text out of the tokens but not sent: it may begin a stop string

    def push(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
        """Add tokens; returns the text to send and whether a stop string ended the text."""
        self.ids += ids
        before = self.decode(self.ids[self.start : self.out])
        text = self.decode(self.ids[self.start :])
        new = ""
        if final or not text.endswith("\ufffd"):
            new = text[len(before) :]
            self.start, self.out = self.out, len(self.ids)
        pending = self.held + new
        cut = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            return pending[:cut], True
        wait = 0 if final else self._stop_start(pending)
        self.held = pending[len(pending) - wait :] if wait else ""
        return pending[: len(pending) - wait], False

    def _stop_start(self, text: str) -> int:
        """How many of the text's last characters begin a stop string (the longest such ending)."""
        return max(
            (n for s in self.stop for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0
        )


WARM_UP_TEXT = "one two three, one two three, one two three, one two three"  # repeats: drafting decoders draft


def warm_up(model: Model, decoder: Decoder) -> float:
    """Decode a short prompt alone and in a batch of two, so the graphs a server needs are compiled
    before its first request; returns the seconds it took."""
    started = time.perf_counter()
    prompt = model.encode_prompt(WARM_UP_TEXT)
    for batch in ([prompt], [prompt, prompt[1:]]):
        decoder.generate(model, batch, max_new_tokens=24)
    return time.perf_counter() - started
