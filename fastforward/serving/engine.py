"""The serving engine: one worker thread schedules requests continuously, step by step.

A request becomes a `Job` (token ids, a built decoder, its budget, stop strings, its sampling seed).
Jobs whose decoders have equal settings (temperature, top-p and seed aside) form a **group**: one
`Session` whose rows are its jobs. Between two steps of a group, waiting jobs of its setting join it
(`Session.join`, prefilled on their own) and finished or cancelled rows leave it (`Session.leave`),
so rows with different budgets, prompt lengths and sampling knobs share forwards and nobody waits for
a batch to drain. Groups of different settings take turns, one step each. Admission is bounded by
`max_batch_size` rows and `max_batch_tokens` tokens in flight (prompt plus budget of every running
row); a queue of more than `max_queue` waiting jobs refuses new ones (`QueueFull`: HTTP 503 with
Retry-After). Between two steps at most `max_prefill_tokens` prompt tokens join (one job at least),
so that a burst of long prompts prefills over several turns: the running rows keep streaming, and
the first jobs of the burst get their first tokens before the last ones are prefilled.

Each row samples with its own request's temperature, top-p and seed (`Job.row`), so a request gets
the tokens it would get alone whatever shares its batch. After every step the session's rows turn
their newly committed tokens into text deltas (`TextStream`: incremental, so a long stream costs no
more per step than a short one), cut the text before a stop string (and cancel that row), cancel the
rows whose clients left, and hand the deltas to the jobs' event queues, which the HTTP layer reads
(`fastforward.serving.app`); a job's last event carries its token ids. A failure inside decoding fails
only the jobs of that group. Other model work (scoring log-probabilities) runs on the same worker
between two steps (`Engine.call`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from fastforward.decoding.decoders import Decoder, registry
from fastforward.decoding.runtime import PREFILL_TOKENS, Generation, Prompt, Session
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.serving.metrics import Metrics

_ids = itertools.count()


@dataclass
class Event:
    """What a job hears: a text delta, or the end (with a finish reason, usage and stats, or an error,
    and the completion's token ids, which log-probabilities are scored on)."""

    delta: str = ""
    finish_reason: str | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None
    token_ids: list[int] | None = None


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
        self.max_prefill_tokens = max_prefill_tokens
        self.max_step_tokens = max_step_tokens  # `Session.step_tokens` of every group
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
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
                names = list(self._groups)
                name = names[self._turn % len(names)]
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
            admitted: dict[str, list[Job]] = {}
            # Rows still decoding: retired ones leave in the join that admits their successors.
            live = [r for g in self._groups.values() for i, r in enumerate(g.rows) if i not in g.retired]
            rows, tokens = len(live), sum(len(r.job.prompt) + r.job.max_tokens for r in live)
            prefill = 0  # prompt tokens admitted in this turn
            for job in list(self._waiting):
                size = len(job.prompt) + job.max_tokens
                full = rows >= self.max_batch_size or (
                    self.max_batch_tokens is not None and tokens + size > self.max_batch_tokens and rows > 0
                )
                # Past the prefill budget it waits for the next turn (a job alone always fits).
                enough = prefill > 0 and prefill + len(job.prompt) > self.max_prefill_tokens
                if full or enough:
                    break
                self._waiting.remove(job)
                admitted.setdefault(job.setting, []).append(job)
                rows, tokens, prefill = rows + 1, tokens + size, prefill + len(job.prompt)
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
        self._post(job, Event(finish_reason=reason, usage=usage, token_ids=list(generation.token_ids)))

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
            job = Job(ids, each, f"warm-up {each.name}", 24, [], loop)
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
