"""Training objectives, one module each: a batch → a layout → a loss (see objectives.base), each
registered by name (objectives.registry)."""

from fastforward.training.objectives.base import Objective
from fastforward.training.objectives.jacobi_forcing import JacobiForcing
from fastforward.training.objectives.multitf import MultiTF
from fastforward.training.objectives.ntp import NTP
from fastforward.training.objectives.registry import OBJECTIVES, make_objective, register
from fastforward.training.objectives.sbd import SBD
from fastforward.training.objectives.setdlm import SetDLM

__all__ = [
    "NTP",
    "OBJECTIVES",
    "SBD",
    "JacobiForcing",
    "MultiTF",
    "Objective",
    "SetDLM",
    "make_objective",
    "register",
]
