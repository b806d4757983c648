"""Objectives and their options, declared once, as decoders are: `@register(name)` on an objective's
class puts it in `OBJECTIVES`, and its fields made with `option(default, help)` are its options, where
`fastforward train` (its --objective choices and one flag per option), `make_objective` and the tests
find them.

Every module in `fastforward.training.objectives` is imported on first lookup (`fastforward.registry`),
so a new objective is one new file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from fastforward.registry import Registry
from fastforward.training.objectives.base import Objective

OBJECTIVES: Registry[type[Objective]] = Registry("objective", "fastforward.training.objectives")

# `@register(name)` on an objective's class (a dataclass whose fields are its options) declares it.
register = OBJECTIVES.named


def make_objective(name: str, **options) -> Objective:
    """An objective by name; `options` not among its fields are ignored, so callers may pass a superset."""
    cls = OBJECTIVES.find(name)
    known = {f.name for f in fields(cls) if f.init}
    return cls(**{k: v for k, v in options.items() if k in known})


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field of an objective that `fastforward train` offers as a flag, with its help and choices."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Option:
    """One option of one or more objectives (fields of the same name are one option, one flag)."""

    name: str
    type: type
    default: Any  # None where the objectives' defaults differ: each keeps its own
    help: str
    choices: tuple[str, ...] | None
    objectives: tuple[str, ...]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def options() -> dict[str, Option]:
    """Every option of every objective, once each, in the order the registry lists them."""
    found: dict[str, Option] = {}
    for name, cls in OBJECTIVES.items():
        for f in fields(cls):
            if not f.init:  # fixed by the objective (MultiTF's suffix_share)
                continue
            seen = found.get(f.name)
            if seen is not None:
                default = seen.default if seen.default == f.default else None
                found[f.name] = replace(seen, default=default, objectives=(*seen.objectives, name))
            else:
                help, choices = f.metadata.get("help", ""), f.metadata.get("choices")
                found[f.name] = Option(f.name, type(f.default), f.default, help, choices, (name,))
    return found
