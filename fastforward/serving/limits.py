"""A request's sizes checked before any work: its prompt's characters before tokenizing, its prompt
tokens plus budget against the model's context (as vLLM answers), the number of choices.

A prompt of more characters than the context's tokens times the longest token of the vocabulary (in
characters) cannot fit, whatever it says: refused before the tokenizer spends seconds on it (a very
large prompt once took that long to tokenize before being refused on its token count).
"""

from __future__ import annotations

from functools import cache

from fastforward.model import Model
from fastforward.serving.schema import MAX_CHOICES, ApiError

MAX_REQUEST_BYTES = 4 * 2**20  # a body past this is refused before it is read (`serve --max-request-bytes`)


@cache
def _longest_token(tokenizer) -> int:
    """Characters of the vocabulary's longest token string (a byte-level token's string has one
    character per byte, so it bounds the text a token stands for)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def check_characters(model: Model, chars: int, param: str) -> None:
    """Refuse a prompt that has more characters than the context can hold in any tokenization."""
    context = model.max_context
    if context is None:
        return
    bound = context * _longest_token(model.tokenizer)
    if chars > bound:
        raise ApiError(
            400,
            f"the prompt has {chars} characters, more than the model's context of {context} tokens can hold "
            f"(at most {bound} characters)",
            param=param,
        )


def budget(model: Model, prompt_tokens: int, asked: int | None, default: int, param: str, prompt_param: str) -> int:
    """The completion's budget in tokens: `asked` if prompt + it fits the context (else a 400 naming
    both numbers, as vLLM), or the server's `default` cut to what the context leaves."""
    context = model.max_context
    if context is not None and prompt_tokens >= context:
        raise ApiError(
            400,
            f"this model's maximum context length is {context} tokens, and the prompt has {prompt_tokens}; "
            "shorten the prompt",
            param=prompt_param,
        )
    if asked is None:
        return default if context is None else min(default, context - prompt_tokens)
    if context is not None and prompt_tokens + asked > context:
        raise ApiError(
            400,
            f"this model's maximum context length is {context} tokens; you requested {prompt_tokens + asked} "
            f"tokens ({prompt_tokens} in the prompt, {asked} in {param}); reduce the prompt or {param}",
            param=param,
        )
    return asked


def check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise ApiError(400, f"{prompts} prompts × n={n} choices is more than {MAX_CHOICES} in one request", param="n")
