"""Decoders: one protocol (`Decoder.begin` and `Decoder.step` on a `Session`), declared in one registry
(`registry.spec(name)`)."""

from fastforward.decoding.decoders.ar import ARDecoder
from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.jacobi import JacobiDecoder
from fastforward.decoding.decoders.multiblock_jacobi import MultiBlockJacobiDecoder
from fastforward.decoding.decoders.sbd import SBDDecoder
from fastforward.decoding.decoders.sbd_verified import VerifiedSBDDecoder
from fastforward.decoding.runtime import Generation, Prompt, Session, Stats

__all__ = [
    "ARDecoder",
    "Decoder",
    "Generation",
    "JacobiDecoder",
    "MultiBlockJacobiDecoder",
    "Prompt",
    "SBDDecoder",
    "Session",
    "Stats",
    "VerifiedSBDDecoder",
]
