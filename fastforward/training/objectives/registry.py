"""Objectives and their options, declared once, as decoders are: `@register(name)` on an objective's
class puts it in `OBJECTIVES`, and its fields made with `option(default, help, bound, choices)`
(`fastforward.options`) are its options, where `fastforward train` (its --objective choices and one
flag per option), `make_objective` and the tests find them. Making the objective checks them.

Every module in `fastforward.training.objectives` is imported on first lookup (`fastforward.registry`),
so a new objective is one new file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fastforward.options import Knob, options_of
from fastforward.registry import Registry
from fastforward.training.objectives.base import Objective

OBJECTIVES: Registry[type[Objective]] = Registry("objective", "fastforward.training.objectives")

# `@register(name)` on an objective's class (a dataclass whose fields are its options) declares it.
register = OBJECTIVES.named


def make_objective(name: str, label: Callable[[Knob], str | None] = lambda knob: None, **options) -> Objective:
    """An objective by name; `options` not among its options are ignored, so callers may pass a superset.
    A bad value is refused naming the option by `label(knob)` (`fastforward train`: its flag)."""
    cls = OBJECTIVES.find(name)
    known = options_of(cls)
    return cls(**{k: known[k].validate(v, label(known[k])) for k, v in options.items() if k in known})


@dataclass(frozen=True)
class Option:
    """One option of one or more objectives (fields of the same name are one option, one flag): its knob,
    whose default is None where the objectives' defaults differ (each keeps its own)."""

    knob: Knob
    objectives: tuple[str, ...]


def options() -> dict[str, Option]:
    """Every option of every objective, once each, in the order the registry lists them. Fields of the
    same name must be declared alike but for their defaults, as they share a flag."""
    found: dict[str, Option] = {}
    for name, cls in OBJECTIVES.items():
        for field_name, knob in options_of(cls).items():
            seen = found.get(field_name)
            if seen is None:
                found[field_name] = Option(knob, (name,))
                continue
            if replace(seen.knob, default=knob.default) != knob:
                raise TypeError(f"objective {name!r} declares option {field_name!r} unlike {seen.objectives[0]!r}")
            default = seen.knob.default if seen.knob.default == knob.default else None
            found[field_name] = Option(replace(seen.knob, default=default), (*seen.objectives, name))
    return found
