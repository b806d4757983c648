"""The engine core: requests in, outputs out, one step at a time. Every caller drives it: in-process
`generate` (`generate` below, and so the evaluation, the lm-eval harness and the recipes), `serve` and
the warm engine (`fastforward.serving.engine`, a thread that delivers its outputs).

It has the shape of vLLM v1's `EngineCore` and nano-vLLM's `LLMEngine`: `add_request`, `step() ->
outputs`, `abort`. A step is

* **schedule**: aborted requests leave the queue; waiting requests join the batches of their decoder
  setting as far as the `scheduler` limits admit them (prefilled on their own, begun, and
  postprocessed as after a step); the batch whose turn it is is picked (batches take turns);
* **step**: that batch's `decoder.step(session)`, one forward, and nothing else inside it;
* **postprocess**: each row's new tokens become text increments (`TextStream`), cut before a stop
  string (which ends the row); aborted rows end; finished rows give their `Generation` and leave the
  batch, their cache rows with them (at the step they finish, or once they are `leave_share` of it),
  unless requests of the same setting wait to take their places at the next join (one copy for both).

A batch is one `Session` (`fastforward.decoding.runtime`): the rows of one decoder setting
(`Decoder.batch_key`) and their cache. A request's row (`Row`) has its one status; the core keeps
nothing beside the rows and the queue. Decoders keep `begin` and `step` and never loop. (Trajectory
collection, `training.trajectories.rollout`, drives one session's `begin` and `step` itself: it records
each row's drafts before every forward, which a core step, admission and forward in one, does not show.)

`isolate_failures`: a failure inside a batch's prefill or step ends only that batch's requests, each
with an error output (the server goes on); off (in-process `generate`), the error is raised.
`leave_share`: finished rows leave once they are this share of their batch (0: at the step they finish).
Measured (benchmarks/finished_rows.py, docs/notes/2026-12-02-engine-core.md): a batch of SmolLM2 prompts
decodes faster when rows leave at once (`jacobi` 1.15×, `ar` 1.06× against staying until the batch
drains), while a server of the small demo model, whose forwards cost less than the copies, served more
tokens/s when they left at a quarter (`serve` sets 0.25), as the server did before.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from fastforward.decoding import scheduler
from fastforward.decoding.prefill import PREFILL_TOKENS
from fastforward.decoding.rows import Generation, GenerationInterrupted, Prompt, Row, Stats, Status
from fastforward.decoding.runtime import Session
from fastforward.decoding.text_stream import TextStream
from fastforward.errors import FastForwardError
from fastforward.model import Model

if TYPE_CHECKING:  # the core drives decoders through their interface; decoders import the core (`Decoder.generate`)
    from fastforward.decoding.decoders.base import Decoder

_ids = itertools.count()


@dataclass(eq=False)  # a request is itself: the queue and the callers key on it
class Request:
    """One prompt to decode: its token ids (or an infilling `Prompt`), its decoder, its budget of new
    tokens and its stop strings; seed: its own sampling seed (None: its decoder's); ignore_eos: decode
    through stop tokens up to `max_tokens` (vLLM's field). `cancelled` is the one field another thread
    sets (`EngineCore.abort`); the core applies it between steps."""

    prompt: Sequence[int] | Prompt
    decoder: Decoder
    max_tokens: int
    stop: Sequence[str] = ()
    _: KW_ONLY
    seed: int | None = None
    ignore_eos: bool = False
    stream_text: bool = True  # text increments in the outputs (else the text comes once, at the end)
    id: int = field(default_factory=lambda: next(_ids))
    created: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    row: Row | None = field(default=None, init=False)  # once admitted
    stream: TextStream | None = field(default=None, init=False)  # its text so far, once admitted
    generation: Generation | None = field(default=None, init=False)  # once finished

    @cached_property
    def setting(self) -> Hashable:
        """Requests of equal settings share a batch: their decoders' options (`Decoder.batch_key`)."""
        return self.decoder.batch_key()

    @property
    def prompt_tokens(self) -> int:
        p = self.prompt
        return len(p.prefix) + len(p.suffix) if isinstance(p, Prompt) else len(p)

    def as_prompt(self) -> Prompt:
        """The request as a session row: its prompt, seed, stop-token choice, and its decoder's temperature
        and top-p (a batch's rows share a decoder setting but not these)."""
        p = self.prompt
        if isinstance(p, Prompt):
            return p
        return Prompt(list(p), seed=self.seed, sampler=self.decoder.sampler, ignore_eos=self.ignore_eos)

    def result(self, decode: Callable[[list[int]], str]) -> Generation:
        """Its generation: the finished one, else what its row has so far ("interrupted"; nothing before
        it was admitted)."""
        if self.generation is not None:
            return self.generation
        if self.row is not None:
            return self.row.result(decode)
        return Generation([], "", Stats(0, 0, 0.0, 0.0), "interrupted")


@dataclass
class Output:
    """What a step tells about one request: new text (`delta`), and once it finished its `generation`
    (why it ended: `generation.finish_reason`), or the `error` that ended it."""

    request: Request
    delta: str = ""
    generation: Generation | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.generation is not None or self.error is not None


class EngineCore:
    """A queue of requests and the batches decoding them (see the module docstring). Not thread-safe
    but for `abort`: one thread drives it."""

    def __init__(
        self,
        model: Model,
        limits: scheduler.Limits | None = None,
        max_step_tokens: int | None = None,
        isolate_failures: bool = False,
        leave_share: float = 0.0,
    ):
        self.model = model
        self.leave_share = leave_share
        self.limits = limits or scheduler.Limits(8, None, PREFILL_TOKENS)
        self.max_step_tokens = max_step_tokens  # `Session.step_tokens` of every batch
        self.isolate_failures = isolate_failures
        self.waiting: deque[Request] = deque()
        self.batches: dict[Hashable, tuple[Decoder, Session]] = {}  # by setting
        self.last_step_rows = 0  # rows the last step ran (the server's metrics)
        self._turn = 0  # round robin over the batches

    # ---- the callers' side ------------------------------------------------------------------------
    def add_request(self, request: Request) -> Request:
        """Queue a request; it joins a batch at a coming step."""
        if isinstance(request.prompt, Prompt) and request.prompt.suffix and not request.decoder.infills:
            raise FastForwardError(
                f"the {request.decoder.name} decoder cannot infill (fill a gap before a suffix); use the setdlm "
                "decoder, or ar on the prefix alone as the baseline"
            )
        if request.max_tokens <= 0:
            raise FastForwardError(f"max_new_tokens must be > 0, got {request.max_tokens}")
        self.waiting.append(request)
        return request

    @staticmethod
    def abort(request: Request) -> None:
        """End a request (its caller left): it leaves the queue, or its row ends, between two steps. Safe
        from any thread."""
        request.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.batches)

    def running(self) -> list[Request]:
        """The requests whose rows are decoding."""
        return [row.owner for _, session in self.batches.values() for row in session.rows if not row.finished]

    @torch.inference_mode()
    def step(self) -> list[Output]:
        """Schedule, step one batch, postprocess: the outputs of every request that changed."""
        outputs: list[Output] = []
        self.last_step_rows = 0
        self._schedule(outputs)
        if self.batches:
            setting = scheduler.next_batch(list(self.batches), self._turn)
            self._turn += 1
            decoder, session = self.batches[setting]
            rows = [row for row in session.rows if not row.finished]
            self.last_step_rows = len(rows)
            with self._failing(setting, [row.owner for row in rows], outputs):
                decoder.step(session)
                self._postprocess(setting, rows, outputs)
        return outputs

    # ---- inside a step ----------------------------------------------------------------------------
    def _schedule(self, outputs: list[Output]) -> None:
        """Aborted requests out of the queue; waiting requests into their batches as far as the limits allow."""
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            outputs.append(self._finish(request, Generation([], "", Stats(0, 0, 0.0, 0.0), "cancelled")))
        admitted = scheduler.admit(self.waiting, self.running(), self.limits)
        for setting, requests in admitted.items():
            for request in requests:
                self.waiting.remove(request)
            self._admit(setting, requests, outputs)

    def _admit(self, setting: Hashable, requests: list[Request], outputs: list[Output]) -> None:
        """Start requests in their setting's batch: their rows prefilled (a failure there fails them alone),
        then a new batch, or rows joining the running one in one join (the finished rows leave in the same
        copy); begun, and postprocessed as after a step."""
        decoder, prefilled = requests[0].decoder, None
        with self._failing(None, requests, outputs):
            budgets = [r.max_tokens for r in requests]
            prefilled = decoder.prefilled(self.model, [r.as_prompt() for r in requests], budgets)
            for row, request in zip(prefilled[0], requests, strict=True):
                row.owner, request.row = request, row
                request.stream = TextStream(self.model.decode, list(request.stop)) if self._streams(request) else None
        if prefilled is None:
            return
        batch = self.batches.get(setting)
        running = [] if batch is None else [row for row in batch[1].rows if not row.finished]
        with self._failing(setting, [row.owner for row in running] + requests, outputs):
            if batch is None:
                session = Session(self.model, *prefilled)
                session.step_tokens = self.max_step_tokens
                self.batches[setting] = (decoder, session)
                new = list(range(len(requests)))
            else:
                session = batch[1]
                new = session.join(*prefilled, drop=_finished(session))
            running = [row for row in session.rows if not row.finished]
            decoder.begin(session, new)
            self._postprocess(setting, running, outputs)

    @staticmethod
    def _streams(request: Request) -> bool:
        """Whether its text is followed step by step: asked for, or needed to find a stop string."""
        return request.stream_text or bool(request.stop)

    def _postprocess(self, setting: Hashable, rows: list[Row], outputs: list[Output]) -> None:
        """After a batch's step (or its rows' start), each of `rows` (running before it): an aborted
        request ends its row; new text goes out, cut before a stop string (which ends the row); a row that
        finished gives its generation. Then the finished rows leave (`_retire`)."""
        for row in rows:
            request: Request = row.owner
            delta, cut = "", False  # cut: a stop string ended the text
            if request.cancelled:
                row.finish(Status.CANCELLED)
            elif request.stream is not None and (new := row.canvas[len(request.stream.ids) : row.length]):
                delta, cut = request.stream.push(new)  # type: ignore[arg-type]
                if cut:
                    row.finish(Status.STOP)
            if row.finished:
                outputs.append(self._end(row, delta, cut))
            elif delta:
                outputs.append(Output(request, delta))
        self._retire(setting)

    def _end(self, row: Row, delta: str, cut: bool) -> Output:
        """A finished row's output: its last text (what was held back, unless a stop string cut it) and its
        generation (the text up to the cut where one did)."""
        request: Request = row.owner
        generation = row.result(self.model.decode)
        if request.stream is not None and not request.cancelled:
            if not cut:
                rest, cut = request.stream.push([], final=True)
                delta += rest
            if cut:  # a stop string ended the text: the text as sent, up to it
                generation.text = _cut_text(generation.text, request.stop)
                generation.finish_reason = Status.STOP.value
        return self._finish(request, generation, delta)

    @staticmethod
    def _finish(request: Request, generation: Generation, delta: str = "") -> Output:
        request.generation = generation
        return Output(request, delta, generation)

    def _retire(self, setting: Hashable) -> None:
        """Finished rows leave their batch once they are `leave_share` of it (each leaving copies the cache of
        the rows that stay), unless requests of its setting wait to take their places at the next join (one
        copy for both); a batch whose rows have all finished closes. Until they leave, finished rows ride
        along in the forwards' shape."""
        if setting not in self.batches:
            return
        session = self.batches[setting][1]
        finished = _finished(session)
        if len(finished) == session.batch:
            del self.batches[setting]
        elif finished and len(finished) >= self.leave_share * session.batch and not self._joining(setting):
            session.leave(finished)

    def _joining(self, setting: Hashable) -> bool:
        return any(request.setting == setting for request in self.waiting)

    @contextmanager
    def _failing(self, setting: Hashable | None, requests: list[Request], outputs: list[Output]) -> Iterator[None]:
        """Run the block; where failures are isolated and it fails, the batch of `setting` closes and
        `requests` end with the error (else the error is raised)."""
        try:
            yield
        except Exception as exc:
            if not self.isolate_failures:
                raise
            self.batches.pop(setting, None)
            for request in requests:
                outputs.append(Output(request, error=f"decoding failed: {type(exc).__name__}: {exc}"))


def _finished(session: Session) -> list[int]:
    return [index for index, row in enumerate(session.rows) if row.finished]


def _cut_text(text: str, stop: Sequence[str]) -> str:
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return text[: min(cuts)] if cuts else text


def generate(
    model: Model,
    decoder: Decoder,
    prompts: Sequence[Sequence[int] | Prompt],
    max_new_tokens: int | Sequence[int] = 256,
    batch_size: int | None = None,
    stop: Sequence[str] = (),
) -> list[Generation]:
    """Decode `prompts` in this process and return their generations in order (`in_order`)."""
    return list(in_order(model, decoder, prompts, max_new_tokens, batch_size, stop))


def in_order(
    model: Model,
    decoder: Decoder,
    prompts: Sequence[Sequence[int] | Prompt],
    max_new_tokens: int | Sequence[int] = 256,
    batch_size: int | None = None,
    stop: Sequence[str] = (),
) -> Iterator[Generation]:
    """Decode `prompts` in this process, each a request of one engine core, `batch_size` rows at a time at
    most (None: all at once; a waiting prompt joins as soon as a row finishes), cut at the first of the
    `stop` strings; yields each prompt's generation, in order, once it and those before it have finished.
    Ctrl-C raises `GenerationInterrupted` with what each prompt not yet yielded had by then."""
    if not prompts:
        raise FastForwardError("no prompts given")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise FastForwardError(f"max_new_tokens must be > 0 (one, or one per prompt), got {max_new_tokens}")
    core = EngineCore(model, scheduler.Limits(batch_size or len(prompts), None, sys.maxsize))
    requests = [
        core.add_request(Request(prompt, decoder, budget, stop, stream_text=False))
        for prompt, budget in zip(prompts, budgets, strict=True)
    ]
    done = 0  # requests yielded
    try:
        while done < len(requests):
            while requests[done].generation is None:
                core.step()
            yield requests[done].generation
            done += 1
    except KeyboardInterrupt as interrupt:
        raise GenerationInterrupted([r.result(model.decode) for r in requests[done:]]) from interrupt
