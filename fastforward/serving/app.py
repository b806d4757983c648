"""The OpenAI-compatible HTTP layer: routes, request checks, OpenAI-style errors, SSE streaming.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(both with `stream`), `GET /metrics` (Prometheus text). A request may choose its decoder and knobs
with extra body fields (`decoder`, `block_size`, `gamma`, ...: the CLI's names and checks, from the
decoder registry); anything it leaves out comes from the server's flags. `temperature` and `top_p`
are knobs of every decoder; `seed` is the request's own (its row's sampling seed), so requests that
differ only in their seeds share a batch. `usage` carries prompt and completion tokens plus `nfe`,
`tpf` and `queries`. Completions use the prompt as raw text (as `fastforward generate
--no-chat-template`); chat applies the model's chat template (as `fastforward generate`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from fastforward.api import build_decoder
from fastforward.decoding.decoders import registry
from fastforward.decoding.runtime import PREFILL_TOKENS
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.serving.engine import Engine, Event, Job, QueueFull
from fastforward.serving.metrics import Metrics

SAMPLING = ("temperature", "top_p")  # request fields that are decoder knobs (a request's `seed` is its row's)
SAMPLING_KNOBS = {knob.name for knob in registry.SAMPLING}  # per row: not part of a batch's setting
# The tokens of one forward over a batch's rows, by default on a CPU, where a forward's cost grows with
# them: `jacobi` at block 16 and 32 rows ran 544 a forward, most of them drafts it rejected. Bounded at
# 128, the shipped Jacobi Forcing model served 1.1-1.2x the tokens/s with 32 clients over HTTP and
# 1.2-1.3x in process, p99 latency 0.8 s against 1.2 s (docs/results.md, "Serving under load").
CPU_STEP_TOKENS = 128


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Request(BaseModel):
    """Fields shared by both endpoints; unknown fields are decoder knobs (checked against the registry)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    decoder: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str]


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


class Server:
    """Holds the model, the server's decoder defaults and the engine; builds the FastAPI app."""

    IGNORED = {"user", "logprobs", "echo", "presence_penalty", "frequency_penalty", "stream_options", "best_of"}

    RETRY_AFTER = 1  # seconds a client refused for a full queue is asked to wait

    def __init__(
        self,
        model: Model,
        name: str,
        decoder: str,
        knobs: dict[str, Any],
        max_batch_size: int,
        max_tokens: int = 256,
        max_batch_tokens: int | None = None,
        max_queue: int = 256,
        continuous: bool = True,
        max_step_tokens: int | None = None,
        max_prefill_tokens: int = PREFILL_TOKENS,
    ):
        """max_step_tokens: `Session.step_tokens` of every batch; None: `CPU_STEP_TOKENS` on a CPU, no
        bound on a GPU (whose forwards cost about the same whatever their tokens). max_prefill_tokens:
        prompt tokens that may join between two steps (`Engine`)."""
        build_decoder(decoder, **knobs)  # the server's own settings must be valid before it starts
        self.model, self.name = model, name
        self.decoder, self.knobs, self.max_tokens = decoder, knobs, max_tokens
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.max_batch_size, self.max_batch_tokens, self.max_queue = max_batch_size, max_batch_tokens, max_queue
        if max_step_tokens is None and model.device.type == "cpu":
            max_step_tokens = CPU_STEP_TOKENS
        self.continuous, self.max_step_tokens = continuous, max_step_tokens
        self.max_prefill_tokens = max_prefill_tokens

    # ---- requests → jobs --------------------------------------------------------------------------
    def job(self, body: _Request, prompt: list[int], max_tokens: int | None) -> Job:
        if body.model != self.name:
            raise ApiError(
                404, f"the model {body.model!r} does not exist; this server serves {self.name!r}", "not_found"
            )
        if body.n != 1:
            raise ApiError(400, f"n={body.n} is not supported: this server returns one choice (n=1)", param="n")
        budget = self.max_tokens if max_tokens is None else max_tokens
        if budget <= 0:
            raise ApiError(400, f"max_tokens must be at least 1, got {budget}", param="max_tokens")
        context = self.model.max_context
        if context is not None and len(prompt) >= context:
            raise ApiError(
                400, f"the prompt has {len(prompt)} tokens but the model's context is {context}", param="messages"
            )
        name = body.decoder or self.decoder
        knobs = dict(self.knobs) if name == self.decoder else {}
        extra = {k: v for k, v in (body.model_extra or {}).items() if k not in self.IGNORED}
        knobs.update(extra)
        knobs.update({k: getattr(body, k) for k in SAMPLING if getattr(body, k) is not None})
        try:
            decoder = build_decoder(name, **knobs)
        except FastForwardError as exc:
            raise ApiError(400, str(exc), param="decoder") from exc
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        # Requests whose decoders differ only in temperature, top-p or seed share a batch: each row
        # samples with its own (`Job.row`).
        shared = {k: v for k, v in knobs.items() if k not in SAMPLING_KNOBS}
        setting = json.dumps({"decoder": name, **shared}, sort_keys=True, default=str)
        return Job(prompt, decoder, setting, budget, stop, asyncio.get_running_loop(), seed=body.seed)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.model.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        if len(messages) == 1 and messages[0].get("role") == "user" and isinstance(messages[0].get("content"), str):
            return self.model.encode_prompt(messages[0]["content"])  # exactly what `fastforward generate` sends
        try:
            ids = self.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template's own error (a bad role, a missing field)
            raise ApiError(400, f"could not apply the chat template: {exc}", param="messages") from exc
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # ---- responses --------------------------------------------------------------------------------
    async def events(self, job: Job, request: Request) -> AsyncIterator[Event]:
        """The job's events until its end; a client that leaves cancels the job."""
        assert self.engine is not None
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
                    event = Event(event.delta + later.delta, later.finish_reason, later.error, later.usage)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not job.done:
                self.engine.cancel(job)

    async def respond(self, job: Job, request: Request, chat: bool, stream: bool) -> Response:
        assert self.engine is not None
        try:
            self.engine.submit(job)
        except QueueFull as exc:
            self.metrics.refused.inc()
            body = error_body(f"the server is busy ({exc}); retry later", "server_busy")
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.RETRY_AFTER)})
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if stream:
            return StreamingResponse(self._stream(job, request, chat, ident, created), media_type="text/event-stream")
        text, end = "", Event(finish_reason="length")
        async for event in self.events(job, request):
            text += event.delta
            if event.finish_reason is not None:
                end = event
        if end.error is not None:
            return JSONResponse(error_body(end.error, "server_error"), status_code=500)
        choice: dict[str, Any] = {"index": 0, "finish_reason": end.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        body = {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.name,
            "choices": [choice],
            "usage": end.usage,
        }
        return JSONResponse(body)

    async def _stream(self, job: Job, request: Request, chat: bool, ident: str, created: int) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        first = True
        async for event in self.events(job, request):
            if event.error is not None:
                yield f"data: {json.dumps(error_body(event.error, 'server_error'))}\n\n"
                return
            if chat:
                delta: dict[str, Any] = {"content": event.delta} if event.delta else {}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": event.finish_reason}
            else:
                choice = {"index": 0, "text": event.delta, "logprobs": None, "finish_reason": event.finish_reason}
            first = False
            chunk = {"id": ident, "object": kind, "created": created, "model": self.name, "choices": [choice]}
            if event.usage is not None:
                chunk["usage"] = event.usage
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    # ---- the app ----------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.engine = Engine(
                self.model,
                self.max_batch_size,
                self.metrics,
                self.max_batch_tokens,
                self.max_queue,
                self.continuous,
                self.max_step_tokens,
                self.max_prefill_tokens,
            )
            yield
            await asyncio.to_thread(self.engine.stop)

        app = FastAPI(title="fastforward", lifespan=lifespan)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError) -> JSONResponse:
            return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            return JSONResponse(error_body(f"invalid request: {problems}", "invalid_request_error"), status_code=400)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models() -> dict:
            card = {"id": self.name, "object": "model", "created": 0, "owned_by": "fastforward"}
            return {"object": "list", "data": [card]}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            self.metrics.requests.labels("completions").inc()
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if len(prompts) != 1 or not prompts[0]:
                raise ApiError(400, "give one non-empty prompt per request", param="prompt")
            ids = self.model.encode_prompt(prompts[0], chat_template=False)
            return await self.respond(self.job(body, ids, body.max_tokens), request, False, body.stream)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatRequest, request: Request) -> Response:
            self.metrics.requests.labels("chat").inc()
            budget = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            job = self.job(body, self.encode_chat(body.messages), budget)
            return await self.respond(job, request, True, body.stream)

        return app
