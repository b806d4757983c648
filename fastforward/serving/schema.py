"""The OpenAI request bodies as this server reads them, and its errors in OpenAI's shape.

A request's fields are of four kinds: OpenAI's (and vLLM's `ignore_eos`) that the server implements,
declared on the models below; fields with no effect on the output (`IGNORED`: accepted); fields the
server does not implement (`UNSUPPORTED`: refused with a 400 naming them, unless they hold the value
that means "off", as clients often send); and the decoder options of the registry (`decoder`,
`block_size`, `gamma`, ...). Anything else is an unrecognized field, as OpenAI answers it. Prompts
come in every form OpenAI allows (text, token ids, a batch of either), chat content as a string or a
list of text parts. Every error is an `ApiError` that names the request's JSON field.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastforward.decoding.decoders import registry

MAX_LOGPROBS = 20  # top log-probabilities a token may ask for (OpenAI's chat bound, vLLM's default)
MAX_CHOICES = 64  # prompts × n of one request: more is a batch job, not a request


class ApiError(Exception):
    """An HTTP error with OpenAI's body (`error_body`)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class OpenAIRequest(BaseModel):
    """Fields of both routes; extra fields are read by `decoder_options`."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # the final chunk always carries `usage`
    decoder: str | None = None
    ignore_eos: bool = False  # vLLM's: decode through stop tokens up to the budget


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class ChatRequest(OpenAIRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# Fields with no effect on what this server returns: accepted and ignored.
IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
)
# Fields the server does not implement, with the values that leave them off (accepted: clients send them).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
_TYPES = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}


def parse(model: type[OpenAIRequest], data: Any) -> OpenAIRequest:
    """The request body (parsed JSON) as `model`; a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or None
        raise ApiError(400, f"invalid field {field!r}: {error['msg']}", param=field) from None


def decoder_options(body: OpenAIRequest) -> dict[str, Any]:
    """The decoder knobs a request sets (its extra fields, `temperature` and `top_p`), after refusing
    unsupported and unknown fields and values of the wrong type."""
    knobs = registry.all_knobs()
    options: dict[str, Any] = {}
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                raise ApiError(400, f"the field {name!r} is not supported by this server", param=name)
            continue
        knob = knobs.get(name)
        if knob is None:
            raise ApiError(400, f"unrecognized request field {name!r}", param=name)
        if not isinstance(value, _TYPES[knob.type]) or (knob.type is not bool and isinstance(value, bool)):
            raise ApiError(400, f"the field {name!r} takes a {knob.type.__name__}, got {value!r}", param=name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ApiError(400, f"the field {name!r} must be a finite number", param=name)
        options[name] = value
    options.update({k: getattr(body, k) for k in ("temperature", "top_p") if getattr(body, k) is not None})
    return options


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completions request: a text, a list of token ids, or a batch of either."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts or not all(prompts):
        raise ApiError(400, "the prompt is empty: give a text or token ids", param="prompt")
    return prompts


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each content a string: a list of text parts becomes their texts joined by
    newlines (as vLLM joins them); a part of another kind (an image, audio, a file) is refused."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400,
                        f"messages[{i}].content[{j}] is a {kind!r} part; this server takes text parts only",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part["text"])
            message = {**message, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
        out.append(message)
    return out
