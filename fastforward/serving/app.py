"""The OpenAI-compatible HTTP layer: routes, requests into engine jobs, responses and SSE streaming.

Endpoints: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`, `POST
/v1/chat/completions` (both with `stream` and `n`), `GET /metrics` (Prometheus text). Every error,
unknown routes and malformed bodies included, has OpenAI's body `{"error": {"message", "type",
"param", "code"}}`, and names the request's JSON fields. What a body may hold: `schema`; what it
passes before any work (API key, size, UTF-8, JSON): `guard`; prompt and budget against the
context: `limits`; log-probabilities (`logprobs`, `top_logprobs`, `echo`): `logprobs`; the jobs'
texts and server-sent events: `replies`.

A request may choose its decoder and knobs with extra body fields (`decoder`, `block_size`, `gamma`,
...: the registry's names and checks); anything it leaves out comes from the server's flags.
`temperature` and `top_p` are knobs of every decoder; `seed` is the request's own (its rows'
sampling seed), so requests that differ only in their seeds share a batch. A request without a seed
samples with a fresh one (from the server's `seed`, when given, a reproducible sequence of them).
Choice i of a request (`n`) samples with seed `seed` for i = 0, else a hash of (seed, i). `usage`
carries prompt and completion tokens plus `nfe`, `tpf` and `queries`. Completions use a text prompt
as raw text (as `fastforward generate --no-chat-template`) or token ids as given; chat applies the
model's chat template (as `fastforward generate`).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from fastforward.decoding.decoders import Decoder, registry
from fastforward.decoding.runtime import PREFILL_TOKENS
from fastforward.decoding.sampling import row_key
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.serving import limits, replies
from fastforward.serving.engine import Engine, Event, Job, QueueFull
from fastforward.serving.guard import ApiKey, read_json
from fastforward.serving.limits import MAX_REQUEST_BYTES
from fastforward.serving.logprobs import Scores, chat_logprobs, completion_logprobs, kept_tokens, score
from fastforward.serving.metrics import Metrics
from fastforward.serving.schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    OpenAIRequest,
    chat_messages,
    completion_prompts,
    decoder_options,
    error_body,
    parse,
)

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Server", "error_body"]

# The tokens of one forward over a batch's rows, by default on a CPU, where a forward's cost grows with
# them: unbounded, `jacobi` with many rows runs hundreds a forward, most of them drafts it rejects.
# Bounded, the server gave more tokens/s at a lower p99 latency (docs/notes/2026-11-28-serving-history.md).
CPU_STEP_TOKENS = 128


class Server:
    """Holds the model, the server's decoder defaults and the engine; builds the FastAPI app."""

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
        max_step_tokens: int | None = None,
        max_prefill_tokens: int = PREFILL_TOKENS,
        api_key: str | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ):
        """knobs: the server's decoder options; its `seed`, if any, does not seed the decoder but the
        draws of requests that send no seed (a reproducible sequence; without it, fresh ones).
        max_step_tokens: `Session.step_tokens` of every batch; None: `CPU_STEP_TOKENS` on a CPU, no
        bound on a GPU (whose forwards cost about the same whatever their tokens). max_prefill_tokens:
        prompt tokens that may join between two steps (`Engine`). api_key: required of every request
        but `/health` (None: none)."""
        knobs = dict(knobs)
        seed = knobs.pop("seed", None)
        registry.spec(decoder).create(**knobs)  # the server's own settings must be valid before it starts
        self.model, self.name = model, name
        self.decoder, self.knobs, self.max_tokens = decoder, knobs, max_tokens
        self.draws = random.Random(seed) if seed is not None else random.SystemRandom()
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.max_batch_size, self.max_batch_tokens, self.max_queue = max_batch_size, max_batch_tokens, max_queue
        if max_step_tokens is None and model.device.type == "cpu":
            max_step_tokens = CPU_STEP_TOKENS
        self.max_step_tokens = max_step_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.api_key, self.max_request_bytes = api_key, max_request_bytes

    # ---- requests → jobs --------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.name:
            message = f"the model {model!r} does not exist; this server serves {self.name!r}"
            raise ApiError(404, message, "not_found_error", param="model", code="model_not_found")

    def decoder_for(self, body: OpenAIRequest) -> Decoder:
        """The request's decoder: the server's, with the request's knobs over its own (requests whose
        decoders have equal options share a batch; temperature, top-p and seed are each row's own)."""
        name = body.decoder or self.decoder
        knobs = dict(self.knobs) if name == self.decoder else {}
        knobs.update(decoder_options(body))
        try:
            spec = registry.spec(name)
            decoder = spec.make(knobs, label=lambda knob: f"field {knob.name!r}")
            if spec.needs_mask:
                self.model.require_mask_token(name)  # a 400 now, not a failure in the middle of decoding
        except FastForwardError as exc:
            raise ApiError(400, str(exc), param="decoder") from exc
        return decoder

    def jobs(self, body: OpenAIRequest, prompts: list[list[int]], budgets: list[int]) -> list[Job]:
        """`body.n` jobs per prompt (prompt-major, as OpenAI numbers choices), each choice with its seed."""
        decoder = self.decoder_for(body)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = body.seed if body.seed is not None else self.draws.randrange(2**63)
        seeds = [seed if i == 0 else row_key(seed, [i]) for i in range(body.n)]
        loop = asyncio.get_running_loop()
        return [
            Job(prompt, decoder, budget, stop, loop, seed=s, ignore_eos=body.ignore_eos)
            for prompt, budget in zip(prompts, budgets, strict=True)
            for s in seeds
        ]

    def job(self, body: OpenAIRequest, prompt: list[int], max_tokens: int) -> Job:
        """One job of a one-choice request (tests and in-process benchmarks)."""
        return self.jobs(body, [prompt], [max_tokens])[0]

    def encode_text(self, text: str, param: str = "prompt") -> list[int]:
        limits.check_characters(self.model, len(text), param)
        return self.model.encode_prompt(text, chat_template=False)

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"a prompt token id is outside the vocabulary [0, {vocab})", param="prompt")
        return ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.model.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        limits.check_characters(self.model, sum(len(m.get("content") or "") for m in messages), "messages")
        if len(messages) == 1 and messages[0].get("role") == "user" and isinstance(messages[0].get("content"), str):
            return self.model.encode_prompt(messages[0]["content"])  # exactly what `fastforward generate` sends
        try:
            ids = self.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template's own error (a bad role, a missing field)
            raise ApiError(400, f"could not apply the chat template: {exc}", param="messages") from exc
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # ---- the two routes ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = parse(CompletionRequest, await read_json(request, self.max_request_bytes))
        self.metrics.requests.labels("completions").inc()
        self.check_model(body.model)
        prompts = completion_prompts(body.prompt)
        limits.check_choices(len(prompts), body.n)
        if body.stream and (body.echo or body.logprobs is not None):
            raise ApiError(400, "logprobs and echo are not supported with stream", param="stream")
        ids = [self.encode_text(p) if isinstance(p, str) else self.check_ids(p) for p in prompts]
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
        budgets = [
            limits.budget(self.model, len(i), body.max_tokens, self.max_tokens, "max_tokens", "prompt") for i in ids
        ]
        jobs = self.jobs(body, ids, budgets) if body.max_tokens != 0 else []
        ident, created = "cmpl-" + uuid.uuid4().hex[:24], int(time.time())
        if body.stream:
            return self.stream(jobs, request, False, ident, created)
        if jobs:
            ends = await self.run(jobs, request)
        else:  # echo alone: the prompts scored, nothing decoded
            ends = [
                ("", Event(finish_reason="length", usage=replies.usage(len(i), 0))) for i in ids for _ in range(body.n)
            ]
        if isinstance(ends, Response):
            return ends
        choices = []
        for index, (text, end) in enumerate(ends):
            prompt, source = ids[index // body.n], prompts[index // body.n]
            choice = {"index": index, "text": text, "finish_reason": end.finish_reason, "logprobs": None}
            if body.echo:
                choice["text"] = (source if isinstance(source, str) else self.model.decode(prompt)) + text
            if body.logprobs is not None:  # echo: the prompt's tokens too, the first without one
                kept = kept_tokens(self.model, end.token_ids or [], text)
                scores = await self.score(prompt + kept, 1 if body.echo else len(prompt), body.logprobs)
                choice["logprobs"] = completion_logprobs(self.model, scores, 0, prompt[0] if body.echo else None)
            choices.append(choice)
        usage = replies.total([end.usage for _, end in ends], [len(i) for i in ids])
        return JSONResponse(self._response(ident, "text_completion", created, choices, usage))

    async def chat(self, request: Request) -> Response:
        body = parse(ChatRequest, await read_json(request, self.max_request_bytes))
        self.metrics.requests.labels("chat").inc()
        self.check_model(body.model)
        limits.check_choices(1, body.n)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.stream and body.logprobs:
            raise ApiError(400, "logprobs are not supported with stream", param="stream")
        ids = self.encode_chat(chat_messages(body.messages))
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        asked = getattr(body, field)
        if asked == 0:
            raise ApiError(400, f"{field} must be at least 1", param=field)
        budget = limits.budget(self.model, len(ids), asked, self.max_tokens, field, "messages")
        jobs = self.jobs(body, [ids], [budget])
        ident, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
        if body.stream:
            return self.stream(jobs, request, True, ident, created)
        ends = await self.run(jobs, request)
        if isinstance(ends, Response):
            return ends
        choices = []
        for index, (text, end) in enumerate(ends):
            choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None}
            choice["finish_reason"] = end.finish_reason
            if body.logprobs:
                kept = kept_tokens(self.model, end.token_ids or [], text)
                scores = await self.score(ids + kept, len(ids), body.top_logprobs or 0)
                choice["logprobs"] = chat_logprobs(self.model, scores)
            choices.append(choice)
        usage = replies.total([end.usage for _, end in ends], [len(ids)])
        return JSONResponse(self._response(ident, "chat.completion", created, choices, usage))

    # ---- responses --------------------------------------------------------------------------------
    def _response(self, ident: str, kind: str, created: int, choices: list[dict], usage: Any) -> dict[str, Any]:
        return {"id": ident, "object": kind, "created": created, "model": self.name, "choices": choices, "usage": usage}

    async def score(self, ids: list[int], start: int, top: int) -> Scores:
        """Log-probabilities on the engine's worker, between two steps (`Engine.call`)."""
        assert self.engine is not None
        return await asyncio.wrap_future(self.engine.call(partial(score, self.model, ids, start, top)))

    def submit(self, jobs: list[Job]) -> Response | None:
        """Queue the jobs, or a 503 (none of them queued) when the engine's queue is full."""
        assert self.engine is not None
        for index, job in enumerate(jobs):
            try:
                self.engine.submit(job)
            except QueueFull as exc:
                for queued in jobs[:index]:
                    self.engine.cancel(queued)
                self.metrics.refused.inc()
                body = error_body(f"the server is busy ({exc}); retry later", "server_busy")
                return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.RETRY_AFTER)})
        return None

    async def run(self, jobs: list[Job], request: Request) -> list[tuple[str, Event]] | Response:
        """Each job's text and last event, or the error response (503 busy, 500 a decoding failure)."""
        assert self.engine is not None
        refused = self.submit(jobs)
        if refused is not None:
            return refused
        ends = await replies.collect(self.engine, jobs, request)
        failed = next((end.error for _, end in ends if end.error is not None), None)
        if failed is not None:
            return JSONResponse(error_body(failed, "server_error"), status_code=500)
        return ends

    def stream(self, jobs: list[Job], request: Request, chat: bool, ident: str, created: int) -> Response:
        assert self.engine is not None
        refused = self.submit(jobs)
        if refused is not None:
            return refused
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created}
        chunks = replies.sse(self.engine, jobs, request, chat, head | {"model": self.name})
        return StreamingResponse(chunks, media_type="text/event-stream")

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
                self.max_step_tokens,
                self.max_prefill_tokens,
            )
            yield
            await asyncio.to_thread(self.engine.stop)

        app = FastAPI(title="fastforward", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
        if self.api_key:
            app.add_middleware(ApiKey, key=self.api_key)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
            if exc.status_code == 404:
                message = f"no route {request.method} {request.url.path}; this server serves /v1/completions, "
                message += "/v1/chat/completions, /v1/models, /health and /metrics"
            elif exc.status_code == 405:
                message = f"{request.url.path} does not take {request.method}"
            else:
                message = str(exc.detail)
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

        @app.exception_handler(Exception)
        async def failed(request: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's shape
            return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error"), status_code=500)

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

        card = {"id": self.name, "object": "model", "created": 0, "owned_by": "fastforward"}

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [card]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str) -> dict:
            self.check_model(model)
            return card

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        return app
