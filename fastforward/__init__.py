"""fastforward: parallel decoding for Hugging Face causal LMs, with an exact KV cache.

The public names below are imported on first use (PEP 562), not when the package is: the
`fastforward` command then starts inside its own error handling, so a Ctrl-C while torch and
transformers load is an interrupt, not a traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "build_decoder": "fastforward.api",
    "generate": "fastforward.api",
    "infill": "fastforward.api",
    "ARDecoder": "fastforward.decoding.decoders",
    "Decoder": "fastforward.decoding.decoders",
    "JacobiDecoder": "fastforward.decoding.decoders",
    "MultiBlockJacobiDecoder": "fastforward.decoding.decoders",
    "SBDDecoder": "fastforward.decoding.decoders",
    "VerifiedSBDDecoder": "fastforward.decoding.decoders",
    "FastForwardError": "fastforward.errors",
    "Layout": "fastforward.model",
    "Model": "fastforward.model",
    "load_model": "fastforward.model",
    "ConfidenceBounded": "fastforward.decoding.policies",
    "EntropyBounded": "fastforward.decoding.policies",
    "Factor": "fastforward.decoding.policies",
    "Threshold": "fastforward.decoding.policies",
    "make_policy": "fastforward.decoding.policies",
    "Generation": "fastforward.decoding.runtime",
    "Prompt": "fastforward.decoding.runtime",
    "Session": "fastforward.decoding.runtime",
    "Stats": "fastforward.decoding.runtime",
    "Sampler": "fastforward.decoding.sampling",
}

__all__ = [
    "ARDecoder",
    "ConfidenceBounded",
    "Decoder",
    "EntropyBounded",
    "Factor",
    "FastForwardError",
    "Generation",
    "JacobiDecoder",
    "Layout",
    "Model",
    "MultiBlockJacobiDecoder",
    "Prompt",
    "SBDDecoder",
    "Sampler",
    "Session",
    "Stats",
    "Threshold",
    "VerifiedSBDDecoder",
    "build_decoder",
    "generate",
    "infill",
    "load_model",
    "make_policy",
]

if TYPE_CHECKING:
    from fastforward.api import build_decoder, generate, infill
    from fastforward.decoding.decoders import (
        ARDecoder,
        Decoder,
        JacobiDecoder,
        MultiBlockJacobiDecoder,
        SBDDecoder,
        VerifiedSBDDecoder,
    )
    from fastforward.decoding.policies import ConfidenceBounded, EntropyBounded, Factor, Threshold, make_policy
    from fastforward.decoding.runtime import Generation, Prompt, Session, Stats
    from fastforward.decoding.sampling import Sampler
    from fastforward.errors import FastForwardError
    from fastforward.model import Layout, Model, load_model


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastforward' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
