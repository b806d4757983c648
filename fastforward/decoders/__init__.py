"""Decoders: one protocol (`Decoder.decode(session)`), one stats type (`Stats`)."""

from fastforward.decoders.ar import ARDecoder
from fastforward.decoders.base import Decoder, Generation, Session, Stats
from fastforward.decoders.jacobi import JacobiDecoder
from fastforward.decoders.multiblock_jacobi import MultiBlockJacobiDecoder
from fastforward.decoders.sbd import SBDDecoder
from fastforward.decoders.sbd_verified import VerifiedSBDDecoder

__all__ = [
    "ARDecoder",
    "Decoder",
    "Generation",
    "JacobiDecoder",
    "MultiBlockJacobiDecoder",
    "SBDDecoder",
    "Session",
    "Stats",
    "VerifiedSBDDecoder",
]
