"""Objective names, declared once, as decoders are: `@register(name)` on an objective's class puts it
in `OBJECTIVES`, where `fastforward train --objective`, `make_objective` and the tests find it.

Every module in `fastforward.training.objectives` is imported on first lookup (`fastforward.registry`),
so a new objective is one new file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import TypeVar

from fastforward.registry import Registry
from fastforward.training.objectives.base import Objective

OBJECTIVES: Registry[type[Objective]] = Registry("objective", "fastforward.training.objectives")

Kind = TypeVar("Kind", bound=type[Objective])


def register(name: str) -> Callable[[Kind], Kind]:
    """Declare an objective under `name`; decorates its class (a dataclass whose fields are its options)."""

    def decorate(cls: Kind) -> Kind:
        cls.name = name
        OBJECTIVES.add(name, cls, cls.__module__)
        return cls

    return decorate


def make_objective(name: str, **options) -> Objective:
    """An objective by name; `options` not among its fields are ignored, so callers may pass a superset."""
    cls = OBJECTIVES.find(name)
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in known})
