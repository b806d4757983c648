"""fastforward: parallel decoding for Hugging Face causal LMs, with an exact KV cache."""

from fastforward.api import build_decoder, generate
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
from fastforward.model import Layout, Model, load_model
from fastforward.policies import ConfidenceBounded, EntropyBounded, Factor, Threshold, make_policy
from fastforward.runtime import Prompt, Session, Stats
from fastforward.sampling import Sampler

__all__ = [
    "ARDecoder",
    "build_decoder",
    "generate",
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
    "load_model",
    "make_policy",
]
