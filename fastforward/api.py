"""The small public entry points: build a decoder by name and generate from text prompts."""

from __future__ import annotations

from fastforward.decoders import (
    ARDecoder,
    Decoder,
    Generation,
    JacobiDecoder,
    MultiBlockJacobiDecoder,
    SBDDecoder,
    VerifiedSBDDecoder,
)
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.policies import make_policy
from fastforward.sampling import Sampler

DECODERS = {
    "ar": ARDecoder,
    "sbd": SBDDecoder,
    "sbd-verified": VerifiedSBDDecoder,
    "jacobi": JacobiDecoder,
    "jacobi-mr": MultiBlockJacobiDecoder,
}


def build_decoder(
    name: str = "ar",
    *,
    block_size: int = 16,
    policy: str = "entropy",
    gamma: float = 0.35,
    first_token_from_ntp: bool = False,
    draft_init: str = "repeat",
    max_blocks: int = 2,
    spawn_ratio: float = 0.85,
    verify: int = 2,
    ngram: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Decoder:
    """A decoder by name with its knobs; unknown names and bad values raise FastForwardError."""
    sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)
    if name == "ar":
        return ARDecoder(sampler)
    if name in ("jacobi", "jacobi-mr", "sbd-verified") and temperature != 0:
        raise FastForwardError(f"{name} decoding is greedy (its output equals greedy AR); use --temperature 0")
    if name == "jacobi":
        return JacobiDecoder(block_size, draft_init, seed)
    if name == "jacobi-mr":
        return MultiBlockJacobiDecoder(block_size, max_blocks, spawn_ratio, verify, ngram)
    if name == "sbd":
        return SBDDecoder(block_size, make_policy(policy, gamma), sampler, first_token_from_ntp)
    if name == "sbd-verified":
        return VerifiedSBDDecoder(block_size, make_policy(policy, gamma))
    raise FastForwardError(f"unknown decoder {name!r}; choose one of {', '.join(DECODERS)}")


def generate(
    model: Model,
    prompts: str | list[str],
    decoder: Decoder | str = "ar",
    max_new_tokens: int = 256,
    chat_template: bool = True,
    **decoder_options,
) -> list[Generation]:
    """Generate for text prompts (one batch, left-padded). Returns one Generation per prompt."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(decoder, str):
        decoder = build_decoder(decoder, **decoder_options)
    encoded = [model.encode_prompt(p, chat_template=chat_template) for p in prompts]
    return decoder.generate(model, encoded, max_new_tokens)
