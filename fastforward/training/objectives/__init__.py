"""Training objectives, one module each: a batch → a layout → a loss (see objectives.base)."""

from __future__ import annotations

from dataclasses import fields

from fastforward.errors import FastForwardError
from fastforward.training.objectives.base import Objective
from fastforward.training.objectives.jacobi_forcing import JacobiForcing
from fastforward.training.objectives.multitf import MultiTF
from fastforward.training.objectives.ntp import NTP
from fastforward.training.objectives.sbd import SBD
from fastforward.training.objectives.setdlm import SetDLM

OBJECTIVES: dict[str, type[Objective]] = {
    "ntp": NTP,
    "sbd": SBD,
    "multitf": MultiTF,
    "setdlm": SetDLM,
    "jacobi_forcing": JacobiForcing,
}


def make_objective(name: str, **options) -> Objective:
    """An objective by name; `options` not among its fields are ignored, so callers may pass a superset."""
    if name not in OBJECTIVES:
        raise FastForwardError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in known})


__all__ = ["NTP", "OBJECTIVES", "SBD", "JacobiForcing", "MultiTF", "Objective", "SetDLM", "make_objective"]
