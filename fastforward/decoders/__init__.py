"""Decoders: one protocol (`Decoder.decode(session)`), declared in one registry (`registry.spec(name)`)."""

from fastforward.decoders.ar import ARDecoder
from fastforward.decoders.base import Decoder
from fastforward.decoders.jacobi import JacobiDecoder
from fastforward.decoders.multiblock_jacobi import MultiBlockJacobiDecoder
from fastforward.decoders.sbd import SBDDecoder
from fastforward.decoders.sbd_verified import VerifiedSBDDecoder
from fastforward.runtime import Generation, Prompt, Session, Stats

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
