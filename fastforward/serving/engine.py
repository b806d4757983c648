"""The serving engine: one worker thread schedules requests continuously, step by step.

A request becomes a `Job` (token ids, a built decoder, its budget, stop strings, its sampling seed).
Jobs whose decoders have equal options (`Decoder.batch_key`: temperature, top-p and seed aside) form
a **group**: one `Session` whose rows are its jobs' (a row's `owner` is its job). The worker's loop
has nano-vLLM's shape, each part a function of its own:

* `_schedule`: work handed to `call` runs (other model work, such as scoring log-probabilities);
  waiting jobs join their groups as far as `scheduler` admits them (rows, tokens in flight and
  prompt tokens per turn bounded), prefilled on their own and begun (`_admit`); the group whose
  turn it is steps next (groups take turns, one step each);
* `decoder.step(session)`: one step of that group's rows, and nothing else runs inside it;
* `_postprocess`: each row's newly committed tokens become text deltas (`TextStream`), cut before a
  stop string (which ends the row); rows whose clients left are cancelled; rows that finished end
  their jobs; finished rows leave the session at the next join (one cache copy for both) or once
  they are a quarter of it (`_retire`).

A row's status (`rows.Status`: running, or finished with its reason) is its request's one state;
the engine keeps nothing beside the rows. Rows with different budgets, prompt lengths and sampling
knobs share forwards, and nobody waits for a batch to drain. A queue of more than `max_queue`
waiting jobs refuses new ones (`QueueFull`: HTTP 503 with Retry-After).

Each row samples with its own request's temperature, top-p and seed (`Job.as_prompt`), so a request
gets the tokens it would get alone whatever shares its batch. Events go to the jobs' event queues,
which the HTTP layer reads (`fastforward.serving.app`); a job's last event carries its token ids. A
failure inside decoding fails only the jobs of that group.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fastforward.decoding.decoders import Decoder
from fastforward.decoding.runtime import PREFILL_TOKENS, Generation, Prompt, Row, Session, Status
from fastforward.model import Model
from fastforward.serving import scheduler
from fastforward.serving.metrics import Metrics
from fastforward.serving.text_stream import TextStream

_ids = itertools.count()


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
    max_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    seed: int | None = None  # the request's own sampling seed (None: the decoder's)
    ignore_eos: bool = False  # decode through stop tokens up to max_tokens (vLLM's field)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False  # its client left: set by the HTTP side, applied to its row between steps
    created: float = field(default_factory=time.perf_counter)
    stream: TextStream | None = None  # its text, once it runs

    @property
    def setting(self) -> Hashable:
        """Jobs of equal settings share a batch: their decoders' options (`Decoder.batch_key`)."""
        return self.decoder.batch_key()

    def as_prompt(self) -> Prompt:
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
class _Group:
    """The rows of one decoder setting, in one session."""

    decoder: Decoder
    session: Session

    def running(self) -> list[Row]:
        return [row for row in self.session.rows if not row.finished]

    def finished(self) -> list[int]:
        """Its finished rows (their jobs ended), until they leave the session."""
        return [index for index, row in enumerate(self.session.rows) if row.finished]


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
        self._groups: dict[Hashable, _Group] = {}  # by setting
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
        """The client left: drop the job if it waits, else its row is cancelled after its group's next step."""
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
        """The worker: schedule → step → postprocess, until `stop` and nothing is left."""
        try:
            while self._wait():
                setting = self._schedule()
                if setting is not None:
                    group = self._groups[setting]
                    rows = group.running()
                    self.metrics.step_rows.observe(len(rows))
                    with self._failing(setting, [row.owner for row in rows]):
                        group.decoder.step(group.session)
                        self._postprocess(setting, group, rows)
                self.metrics.batch_size.set(sum(len(g.running()) for g in self._groups.values()))
                self._flush()
        finally:
            self._flush()

    def _wait(self) -> bool:
        """Wait for work: False once the engine stops with nothing left to do."""
        with self._lock:
            while not (self._waiting or self._groups or self._calls or self._stopping):
                self._lock.wait()
            return bool(self._waiting or self._groups or self._calls)

    def _schedule(self) -> Hashable | None:
        """Between two steps: the work handed to `call`, then waiting jobs into their groups as far as the
        limits allow; returns the setting whose group steps next (None: no group runs)."""
        with self._lock:
            calls, self._calls = self._calls, []
        self._run_calls(calls)
        with self._lock:
            live = [row.owner for group in self._groups.values() for row in group.running()]
            admitted = scheduler.admit(self._waiting, live, self.limits)
            for jobs in admitted.values():
                for job in jobs:
                    self._waiting.remove(job)
            self.metrics.queue_depth.set(len(self._waiting))
        for setting, jobs in admitted.items():
            self._admit(setting, jobs)
        if not self._groups:
            return None
        self._turn += 1
        return scheduler.next_batch(list(self._groups), self._turn - 1)

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

    @contextmanager
    def _failing(self, setting: Hashable | None, jobs: list[Job]) -> Iterator[None]:
        """Run the block (under inference mode); if it fails, the group of `setting` closes and `jobs`
        end with the error, and the server goes on."""
        try:
            with torch.inference_mode():
                yield
        except Exception as exc:  # one group fails; the server goes on
            self._groups.pop(setting, None)
            for job in jobs:
                self._post(job, Event(finish_reason="error", error=f"decoding failed: {type(exc).__name__}: {exc}"))
            self.metrics.failures.inc(len(jobs))

    def _admit(self, setting: Hashable, jobs: list[Job]) -> None:
        """Start jobs in their setting's group: their rows prefilled (a failure there fails them alone),
        then a new session, or rows joining the running one (in one join, each with its own budget; the
        finished rows leave in the same copy); begun, and postprocessed as after a step."""
        decoder, prefilled = jobs[0].decoder, None
        with self._failing(None, jobs):
            prefilled = decoder.prefilled(self.model, [job.as_prompt() for job in jobs], [j.max_tokens for j in jobs])
            for row, job in zip(prefilled[0], jobs, strict=True):
                row.owner, job.stream = job, TextStream(self.model.decode, job.stop)
        if prefilled is None:
            return
        group = self._groups.get(setting)
        running = [] if group is None else group.running()
        with self._failing(setting, [row.owner for row in running] + jobs):
            if group is None:
                group = self._groups[setting] = _Group(decoder, Session(self.model, *prefilled))
                group.session.step_tokens = self.max_step_tokens
                new = list(range(len(jobs)))
            else:
                new = group.session.join(*prefilled, drop=group.finished())
            running = group.running()
            decoder.begin(group.session, new)
            self._postprocess(setting, group, running)

    def _postprocess(self, setting: Hashable, group: _Group, rows: list[Row]) -> None:
        """After a group's step (or its rows' start), each of `rows` (running before it): a client that
        left cancels its row; new text goes to the row's job, cut before a stop string (which ends the
        row); a row that finished ends its job. Then finished rows may leave (`_retire`). The events go
        out once all this has held (so no job hears of its end twice if it fails), together."""
        events: list[tuple[Job, Event]] = []
        for row in rows:
            job: Job = row.owner
            assert job.stream is not None
            cut = False  # a stop string ended the text
            if job.cancelled:
                row.finish(Status.CANCELLED)  # nothing more to tell: its client left
            elif new := row.canvas[len(job.stream.ids) : row.length]:
                delta, cut = job.stream.push(new)  # type: ignore[arg-type]
                if delta:
                    events.append((job, Event(delta=delta)))
                if cut:
                    row.finish(Status.STOP)
            if row.finished:
                events += self._end(row, cut)
        self._retire(setting, group)
        self._outbox += events
        self._flush()

    def _end(self, row: Row, cut: bool) -> list[tuple[Job, Event]]:
        """A finished row's figures into the metrics, and unless its client left, its job's last text (the
        text held back, unless a stop string `cut` it) and its end."""
        job: Job = row.owner
        generation = row.result(self.model.decode)
        stats = generation.stats
        self.metrics.observe(stats.nfe, stats.tokens, time.perf_counter() - job.created, stats.queries)
        if job.cancelled:
            return []
        events = []
        if not cut:
            assert job.stream is not None
            delta, cut = job.stream.push([], final=True)
            if delta:
                events.append((job, Event(delta=delta)))
        reason = "stop" if cut or generation.finish_reason == "stop" else "length"
        usage = self._usage(job, stats.tokens, stats.nfe, stats.queries)
        end = Event(finish_reason=reason, usage=usage, token_ids=list(generation.token_ids), generation=generation)
        return [*events, (job, end)]

    def _retire(self, setting: Hashable, group: _Group) -> None:
        """Finished rows leave the session at the next join (one cache copy for both), or now once they are
        a quarter of it; a group whose rows have all finished closes."""
        finished = group.finished()
        if len(finished) == group.session.batch:
            del self._groups[setting]
        elif finished and 4 * len(finished) >= group.session.batch:
            group.session.leave(finished)

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
