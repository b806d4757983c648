"""fastforward: parallel decoding for Hugging Face causal LMs, with an exact KV cache.

The public names below are imported on first use (PEP 562), not when the package is: the
`fastforward` command then starts inside its own error handling, so a Ctrl-C while torch and
transformers load is an interrupt, not a traceback.
"""

from __future__ import annotations

import importlib
from typing import Any

# The public API, declared once: each module and the names it gives. `__all__`, attribute lookup and
# `dir()` come from here. Every decoder class is public (tests/test_registries.py checks the registry's).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "fastforward.api": ("build_decoder", "generate", "infill"),
    "fastforward.errors": ("FastForwardError",),
    "fastforward.model": ("Layout", "Model", "Precision", "load_model"),
    "fastforward.decoding.runtime": ("Generation", "Prompt", "Session", "Stats"),
    "fastforward.decoding.sampling": ("Sampler",),
    "fastforward.decoding.policies": ("ConfidenceBounded", "EntropyBounded", "Factor", "Threshold", "make_policy"),
    "fastforward.decoding.decoders.base": ("Decoder",),
    "fastforward.decoding.decoders.ar": ("ARDecoder",),
    "fastforward.decoding.decoders.jacobi": ("JacobiDecoder",),
    "fastforward.decoding.decoders.lookup": ("PromptLookupDecoder",),
    "fastforward.decoding.decoders.mbd": ("MultiBlockDiffusionDecoder",),
    "fastforward.decoding.decoders.multiblock_jacobi": ("MultiBlockJacobiDecoder",),
    "fastforward.decoding.decoders.sbd": ("SBDDecoder",),
    "fastforward.decoding.decoders.sbd_slide": ("SlidingSBDDecoder",),
    "fastforward.decoding.decoders.sbd_verified": ("VerifiedSBDDecoder",),
    "fastforward.decoding.decoders.setdlm": ("SetDiffusionDecoder",),
}
_EXPORTS = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastforward' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
