"""The small public entry points: build a decoder by name and generate from text prompts."""

from __future__ import annotations

from typing import Any

from fastforward.decoders import Decoder, Generation, registry
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
    **decoder_options: Any,
) -> list[Generation]:
    """Generate for text prompts (one batch, left-padded). Returns one Generation per prompt."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(decoder, str):
        decoder = build_decoder(decoder, **decoder_options)
    encoded = [model.encode_prompt(p, chat_template=chat_template) for p in prompts]
    return decoder.generate(model, encoded, max_new_tokens)
