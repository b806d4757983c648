"""The serving engine: one worker thread schedules requests continuously, step by step.

A request becomes a `Job` (token ids, a built decoder, its budget, stop strings, its sampling seed).
Jobs whose decoders have equal settings (temperature, top-p and seed aside) form a **group**: one
`Session` whose rows are its jobs. Between two steps of a group, waiting jobs of its setting join it
(`Session.join`, prefilled on their own) and finished or cancelled rows leave it (`Session.leave`),
so rows with different budgets, prompt lengths and sampling knobs share forwards and nobody waits for
a batch to drain. Which jobs join and which group steps next is `scheduler`'s (rows, tokens in flight
and prompt tokens per turn bounded; groups taking turns, one step each); a queue of more than
`max_queue` waiting jobs refuses new ones (`QueueFull`: HTTP 503 with Retry-After).

Each row samples with its own request's temperature, top-p and seed (`Job.row`), so a request gets
the tokens it would get alone whatever shares its batch. After every step the session's rows turn
their newly committed tokens into text deltas (`TextStream`), cut the text before a stop string (and
cancel that row), cancel the rows whose clients left, and hand the deltas to the jobs' event queues,
which the HTTP layer reads (`fastforward.serving.app`); a job's last event carries its token ids. A
failure inside decoding fails only the jobs of that group. Other model work (scoring
log-probabilities) runs on the same worker between two steps (`Engine.call`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from fastforward.decoding.decoders import Decoder, registry
from fastforward.decoding.runtime import PREFILL_TOKENS, Generation, Prompt, Session
from fastforward.model import Model
from fastforward.serving import scheduler
from fastforward.serving.metrics import Metrics
from fastforward.serving.text_stream import TextStream

_ids = itertools.count()
SAMPLING_KNOBS = {knob.name for knob in registry.SAMPLING}  # per row: not part of a batch's setting


def batch_setting(decoder: str, knobs: dict[str, Any]) -> str:
    """A job's `setting`: the decoder and its knobs but the sampling ones (each row's own), so that jobs
    of equal settings share a batch."""
    shared = {k: v for k, v in knobs.items() if k not in SAMPLING_KNOBS}
    return json.dumps({"decoder": decoder, **shared}, sort_keys=True, default=str)


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
class Job:
    prompt: list[int]
    decoder: Decoder
    setting: str  # decoders with equal settings (sampling knobs aside: each row has its own) share a batch
    max_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    seed: int | None = None  # the request's own sampling seed (None: the decoder's)
    ignore_eos: bool = False  # decode through stop tokens up to max_tokens (vLLM's field)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    created: float = field(default_factory=time.perf_counter)
    done: bool = False

    def row(self) -> Prompt:
        """The job as a session row: its prompt, its seed, its stop tokens, and its decoder's temperature
        and top-p (a group's rows share a decoder setting but not these)."""
        return Prompt(self.prompt, seed=self.seed, sampler=self.decoder.sampler, ignore_eos=self.ignore_eos)

    def send(self, event: Event) -> None:
        """Thread-safe: deliver an event to the HTTP side."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _deliver(items: list[tuple[Job, Event]]) -> None:
    """On a job's event loop: put each event in its job's queue."""
    for job, event in items:
        job.events.put_nowait(event)


class QueueFull(RuntimeError):
    """The engine holds `max_queue` waiting jobs already: the request should be retried later."""


@dataclass
class _Row:
    """A job decoding in a session row: its text stream and the tokens already handed to it."""

    job: Job
    stream: TextStream
    sent: int = 0


@dataclass
class _Group:
    """The running jobs of one decoder setting: a session whose row r is rows[r]."""

    decoder: Decoder
    session: Session
    retired: list[int] = field(default_factory=list)  # finished rows, their jobs ended, still in the session

    @property
    def rows(self) -> list[_Row]:
        """Row r's job: each session row owns its own, so that joins and leaves keep them together."""
        return [row.owner for row in self.session.rows]

    def start(self, rows: list[int], jobs: list[Job], decode: Callable[[list[int]], str]) -> None:
        """The jobs now in session rows `rows` (just joined or opened)."""
        for index, job in zip(rows, jobs, strict=True):
            self.session.rows[index].owner = _Row(job, TextStream(decode, job.stop))


class Engine:
    """A queue of jobs and the worker thread that schedules them (see the module docstring)."""

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
        self.limits = scheduler.Limits(max_batch_size, max_batch_tokens, max_prefill_tokens)
        self.max_step_tokens = max_step_tokens  # `Session.step_tokens` of every group
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._waiting: deque[Job] = deque()
        self._calls: list[tuple[Callable[[], Any], Future]] = []  # work to run between two steps (`call`)
        self._outbox: list[tuple[Job, Event]] = []  # events of this step, delivered by `_flush`
        self._groups: dict[str, _Group] = {}
        self._turn = 0  # round robin over the groups
        self._lock = threading.Condition()
        self._stopping = False
        self._worker = threading.Thread(target=self._run, name="fastforward-engine", daemon=True)
        self._worker.start()

    # ---- the HTTP side ----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already")
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
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
        """The client left: drop the job if it waits, else its row is cancelled at the next step."""
        job.cancelled = True
        self.metrics.cancelled.inc()
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.queue_depth.set(len(self._waiting))

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, let the worker finish the rows in flight, fail the jobs still waiting."""
        with self._lock:
            self._stopping = True
            left = list(self._waiting)
            self._waiting.clear()
            calls, self._calls = self._calls, []
            self._lock.notify()
        for _, future in calls:
            future.set_exception(RuntimeError("the server shut down before this request started"))
        for job in left:
            job.send(Event(finish_reason="error", error="the server shut down before this request started"))
        self._worker.join(timeout)

    # ---- the worker -------------------------------------------------------------------------------
    def _post(self, job: Job, event: Event) -> None:
        """Queue an event for a job; `_flush` hands a step's events over together."""
        self._outbox.append((job, event))

    def _flush(self) -> None:
        """Deliver the queued events: one wake-up of each event loop per step, not one per event (with
        dozens of streaming rows, waking the HTTP side per token costs the worker its GIL time)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for job, event in self._outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._outbox = []
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _run(self) -> None:
        try:
            self._schedule()
        finally:
            self._flush()

    def _schedule(self) -> None:
        while True:
            self._flush()
            if not self._admit():
                return
            if self._groups:
                name = scheduler.next_batch(list(self._groups), self._turn)
                self._turn += 1
                group = self._groups[name]
                self._guarded([r.job for r in group.rows], lambda: self._step(name, group))  # noqa: B023
            self.metrics.batch_size.set(sum(len(g.rows) - len(g.retired) for g in self._groups.values()))

    def _admit(self) -> bool:
        """Move waiting jobs into their groups (opening groups as needed), as far as the limits allow.
        Work handed to `call` runs first. Returns False when there is nothing left to do: stop."""
        with self._lock:
            while not (self._waiting or self._groups or self._calls or self._stopping):
                self._lock.wait()
            calls, self._calls = self._calls, []
        self._run_calls(calls)
        with self._lock:
            if not self._waiting and not self._groups:
                return bool(calls)
            # Rows still decoding: retired ones leave in the join that admits their successors.
            live = [r.job for g in self._groups.values() for i, r in enumerate(g.rows) if i not in g.retired]
            admitted = scheduler.admit(self._waiting, live, self.limits)
            for jobs in admitted.values():
                for job in jobs:
                    self._waiting.remove(job)
            self.metrics.queue_depth.set(len(self._waiting))
        for setting, jobs in admitted.items():
            self._guarded(jobs, lambda: self._join(setting, jobs))  # noqa: B023
        return True

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

    def _guarded(self, jobs: list[Job], work: Callable[[], None]) -> None:
        """Run `work`; if it fails, fail `jobs` (and the group they belong to) and go on."""
        try:
            with torch.inference_mode():
                work()
        except Exception as exc:  # one group fails; the server goes on
            for name, group in list(self._groups.items()):
                if any(r.job in jobs for r in group.rows):
                    del self._groups[name]
            for job in jobs:
                if not job.done:
                    job.done = True
                    self._post(job, Event(finish_reason="error", error=f"decoding failed: {type(exc).__name__}: {exc}"))
            self.metrics.failures.inc(len(jobs))

    def _join(self, setting: str, jobs: list[Job]) -> None:
        """Start jobs in their setting's group: a new session, or rows joining the running one (in one
        join, each with its own budget; the rows retired since the last join leave in the same copy)."""
        group = self._groups.get(setting)
        prompts = [job.row() for job in jobs]
        budgets = [job.max_tokens for job in jobs]
        if group is None:
            decoder = jobs[0].decoder
            group = _Group(decoder, decoder.open_session(self.model, prompts, budgets))
            group.session.step_tokens = self.max_step_tokens
            group.session.on_step = lambda s, g=group: self._stream(g)
            self._groups[setting] = group
            rows = list(range(len(prompts)))
        else:
            rows = group.session.join(prompts, budgets, drop=group.retired)
            group.retired = []
        group.start(rows, jobs, self.model.decode)
        group.decoder.begin(group.session, rows)
        self._stream(group)
        self._retire(setting, group)

    def _step(self, setting: str, group: _Group) -> None:
        self.metrics.step_rows.observe(group.session.batch - len(group.retired))
        group.decoder.step(group.session)  # streams through the session's on_step
        self._retire(setting, group)

    def _stream(self, group: _Group) -> None:
        """After a step: each row's new text to its job, and the rows whose clients left cancelled."""
        session = group.session
        lengths = session.lengths
        for index, row in enumerate(group.rows):
            if row.job.done:
                continue
            if row.job.cancelled:
                session.cancel(index)
                row.job.done = True
                continue
            if lengths[index] > row.sent:
                ids = session.rows[index].canvas[row.sent : lengths[index]]
                row.sent = lengths[index]
                self._emit(session, index, row.job, row.stream.push(ids))
        self._flush()  # once a step

    def _retire(self, setting: str, group: _Group) -> None:
        """Finished rows end their jobs at once, and leave the session at the next join (one cache copy
        for both), or now once they are a quarter of it; a group whose rows have all finished closes."""
        session = group.session
        for index in range(session.batch):
            if session.rows[index].finished and index not in group.retired:
                group.retired.append(index)
                self._finish(group.rows[index], session.result(index))
        if len(group.retired) == session.batch:
            del self._groups[setting]
        elif group.retired and 4 * len(group.retired) >= session.batch:
            session.leave(group.retired)
            group.retired = []

    def _finish(self, row: _Row, generation: Generation) -> None:
        job = row.job
        self.metrics.observe(
            generation.stats.nfe, len(generation.token_ids), time.perf_counter() - job.created, generation.stats.queries
        )
        if job.done:
            return
        delta, stopped = row.stream.push(generation.token_ids[row.sent :], final=True)
        if delta:
            self._post(job, Event(delta=delta))
        job.done = True
        reason = "stop" if stopped or generation.finish_reason == "stop" else "length"
        usage = self._usage(job, len(generation.token_ids), generation.stats.nfe, generation.stats.queries)
        self._post(
            job, Event(finish_reason=reason, usage=usage, token_ids=list(generation.token_ids), generation=generation)
        )

    def _emit(self, session: Session, row: int, job: Job, pushed: tuple[str, bool]) -> None:
        """Send a row's new text (`TextStream.push`); after a stop string, end the job and cancel the row."""
        delta, stopped = pushed
        if delta:
            self._post(job, Event(delta=delta))
        if stopped:
            session.cancel(row)
            job.done = True
            ended = session.rows[row]
            usage = self._usage(job, ended.length, ended.forwards, ended.queries)
            self._post(job, Event(finish_reason="stop", usage=usage, token_ids=ended.output))

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
