"""The small public entry points: build a decoder by name, generate from text prompts, infill."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastforward.decoding import engine_core
from fastforward.decoding.decoders import ARDecoder, Decoder, Generation, Prompt, registry
from fastforward.errors import FastForwardError
from fastforward.model import Model


def build_decoder(name: str = "ar", **knobs: Any) -> Decoder:
    """A decoder by name with its knobs (`fastforward decoders` lists them); unknown names, options
    that do not apply, and bad values raise FastForwardError."""
    return registry.spec(name).create(**knobs)


def generate(
    model: Model,
    prompts: str | list[str],
    decoder: Decoder | str = "ar",
    max_new_tokens: int = 256,
    chat_template: bool = True,
    stop: Sequence[str] = (),
    batch_size: int | None = None,
    **decoder_options: Any,
) -> list[Generation]:
    """Generate for text prompts through the engine core: `batch_size` at a time at most (None: all in
    one batch), each text cut before the first of the `stop` strings. Returns one Generation per prompt."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(decoder, str):
        decoder = build_decoder(decoder, **decoder_options)
    encoded = [model.encode_prompt(p, chat_template=chat_template) for p in prompts]
    return engine_core.generate(model, decoder, encoded, max_new_tokens, batch_size, stop)


def infill(
    model: Model,
    prefix: str | list[str],
    suffix: str | list[str],
    middle_tokens: int,
    decoder: Decoder | str = "setdlm",
    **decoder_options: Any,
) -> list[Generation]:
    """Fill `middle_tokens` positions between each prefix and suffix (raw text, no chat template),
    batched. A decoder that cannot infill is refused, except `ar`, the baseline, which continues
    the prefix alone for `middle_tokens` tokens without seeing the suffix."""
    prefixes, suffixes = ([prefix], [suffix]) if isinstance(prefix, str) else (prefix, suffix)
    if isinstance(suffixes, str) or len(prefixes) != len(suffixes):
        raise FastForwardError("give as many suffixes as prefixes")
    if middle_tokens <= 0:
        raise FastForwardError(f"middle_tokens must be >= 1, got {middle_tokens}")
    if isinstance(decoder, str):
        decoder = build_decoder(decoder, **decoder_options)
    heads = [model.encode_prompt(p, chat_template=False) for p in prefixes]
    if isinstance(decoder, ARDecoder):
        return decoder.generate(model, heads, middle_tokens)
    tails = [model.tokenizer(s, add_special_tokens=False)["input_ids"] for s in suffixes]
    if not all(tails):
        raise FastForwardError("a suffix is empty; infilling needs text after the gap (or use generate)")
    rows = [Prompt(h, t, middle_tokens) for h, t in zip(heads, tails, strict=True)]
    return decoder.generate(model, rows, middle_tokens)
