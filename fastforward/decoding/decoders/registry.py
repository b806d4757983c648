"""Decoder names and knobs, declared once: the CLI flags, `build_decoder`, sweeps and the table of docs/decoders.md
all come from here.

A decoder module registers itself with `@register(name, knobs=..., summary=...)` on a function that
builds the decoder from its knob values. Every module in `fastforward.decoding.decoders` is imported on first
lookup, so a new method is one new file. Knobs with the same name are one knob (one CLI flag); a
decoder may give it its own default with `knob.with_default(value)`. A decoder that declares the
`SAMPLING` knobs gets them as one `Sampler`, its build function's `sampler` argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastforward.decoding.policies import POLICIES
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.registry import Registry


@dataclass(frozen=True)
class Knob:
    """One decoder option: its type, default, help, and the rule a value must satisfy."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # the `check` in words, for error messages: "> 0", "in (0, 1]"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def with_default(self, default: Any) -> Knob:
        return replace(self, default=default)

    def parse(self, text: str) -> Any:
        """A value from command-line text (sweeps), validated."""
        if self.type is bool:
            return self.validate(text.strip().lower() in ("1", "true", "yes", "on"))
        try:
            return self.validate(self.type(text.strip()))
        except ValueError as exc:
            raise FastForwardError(f"{self.flag} takes {self.type.__name__} values, got {text!r}") from exc

    def validate(self, value: Any, label: str | None = None) -> Any:
        """The value, if allowed; label: how errors name the knob (default its CLI flag; the server
        names its JSON field)."""
        label = label or self.flag
        if self.choices is not None and value not in self.choices:
            raise FastForwardError(f"{label}: unknown value {value!r}; choose one of {', '.join(self.choices)}")
        if self.check is not None and not self.check(value):
            raise FastForwardError(f"{self.name.replace('_', ' ')} must be {self.rule}, got {value} ({label})")
        return value


@dataclass(frozen=True)
class DecoderSpec:
    """A registered decoder: how to build it, its knobs, and what it promises."""

    name: str
    build: Callable[..., Any]
    knobs: tuple[Knob, ...]
    summary: str
    lossless: bool = False  # output equals AR decoding of the same model (greedy, or sampled with the same seed)
    needs_mask: bool = False  # needs a model trained with a mask token

    def knob(self, name: str) -> Knob | None:
        return next((k for k in self.knobs if k.name == name), None)

    def create(self, **values: Any) -> Any:
        """The decoder with these knob values (the rest at their defaults), errors naming CLI flags."""
        return self.make(values)

    def make(self, values: dict[str, Any], label: Callable[[Knob], str] = lambda knob: knob.flag) -> Any:
        """The decoder with these knob values (the rest at their defaults).

        A knob the decoder does not take is accepted only at its neutral default (so one set of
        options can serve several decoders); any other value, and any bad value, raises, naming
        each knob by `label` (its CLI flag; the server passes its JSON field name).
        """
        chosen = {k.name: k.default for k in self.knobs}
        known = all_knobs()
        for name, value in values.items():
            knob = self.knob(name)
            if knob is not None:
                chosen[name] = knob.validate(value, label(knob))
                continue
            if name not in known:
                raise FastForwardError(f"unknown decoder option {name!r}; the options are {', '.join(known)}")
            if value != known[name].default:
                options = ", ".join(label(k) for k in self.knobs) or "none"
                raise FastForwardError(
                    f"{label(known[name])} {value} does not apply to the {self.name!r} decoder; its options: {options}"
                )
        if all(self.knob(k.name) for k in SAMPLING):
            chosen["sampler"] = Sampler(**{k.name: chosen.pop(k.name) for k in SAMPLING})
        return self.build(**chosen)


DECODERS: Registry[DecoderSpec] = Registry("decoder", "fastforward.decoding.decoders")
_KNOBS: dict[str, Knob] = {}


def register(
    name: str, *, knobs: tuple[Knob, ...], summary: str, lossless: bool = False, needs_mask: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a decoder; decorates the function that builds it from keyword knob values."""

    def decorate(build: Callable[..., Any]) -> Callable[..., Any]:
        for knob in knobs:
            known = _KNOBS.setdefault(knob.name, knob)
            if replace(known, default=knob.default) != knob:
                raise TypeError(f"decoder {name!r} declares knob {knob.name!r} unlike an earlier declaration")
        DECODERS.add(name, DecoderSpec(name, build, knobs, summary, lossless, needs_mask), build.__module__)
        return build

    return decorate


def specs() -> dict[str, DecoderSpec]:
    """Every registered decoder by name, in the order of their modules' names (`fastforward.registry`)."""
    return dict(DECODERS)


def all_knobs() -> dict[str, Knob]:
    """Every knob of every decoder, once each (with the default of its first declaration in `specs` order)."""
    knobs: dict[str, Knob] = {}
    for s in specs().values():
        for knob in s.knobs:
            knobs.setdefault(knob.name, knob)
    return knobs


def spec(name: str) -> DecoderSpec:
    return DECODERS.find(name)


def knob_table() -> str:
    """The table of `fastforward decoders` and docs/decoders.md: each decoder, its knobs and their defaults."""
    lines = ["| decoder | what it does | lossless | options (default) |", "|---|---|---|---|"]
    for s in specs().values():
        options = ", ".join(f"`{k.flag}` ({_show(k.default)})" for k in s.knobs) or "—"
        lines.append(f"| `{s.name}` | {s.summary} | {'yes' if s.lossless else 'no'} | {options} |")
    lines += ["", "| option | meaning |", "|---|---|"]
    for k in all_knobs().values():
        allowed = f" One of {', '.join(k.choices)}." if k.choices else (f" Must be {k.rule}." if k.rule else "")
        lines.append(f"| `{k.flag}` | {k.help}.{allowed} |")
    return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


# ---- knobs shared by several decoders ------------------------------------------------------------
def _positive(value: float) -> bool:
    return value > 0


def fraction(name: str, default: float, help: str) -> Knob:
    """A knob whose values are shares or probabilities, in [0, 1]."""
    return Knob(name, float, default, help, check=lambda v: 0 <= v <= 1, rule="in [0, 1]")


BLOCK_SIZE = Knob("block_size", int, 16, "tokens per block (masks or drafts)", check=_positive, rule="> 0")
POLICY = Knob("policy", str, "entropy", "reveal policy: which masked positions a forward fills", tuple(POLICIES))
GAMMA = Knob(
    "gamma",
    float,
    0.35,
    "the policy's bound: entropy or confidence budget γ, factor f, or threshold τ",
    check=lambda v: v >= 0,
    rule=">= 0",
)
FIRST_TOKEN_FROM_NTP = Knob(
    "first_token_from_ntp",
    bool,
    False,
    "take the first masked position's token from the next-token prediction (sbd: each block's first; "
    "setdlm: every step's, then the run of confident positions after it)",
)
TEMPERATURE = Knob("temperature", float, 0.0, "sampling temperature (0 = greedy)", check=lambda v: v >= 0, rule=">= 0")
TOP_P = Knob("top_p", float, 1.0, "nucleus sampling mass", check=lambda v: 0 < v <= 1, rule="in (0, 1]")
SEED = Knob("seed", int, 0, "seed of sampling and of random draft initialisation")
SAMPLING = (TEMPERATURE, TOP_P, SEED)
