"""Decoder names and options, declared once: the CLI flags, `build_decoder`, the server's request
fields, sweeps and the table of docs/decoders.md all come from here.

A decoder is a dataclass whose option fields are its knobs (`fastforward.options`), each with
its default, help and bounds beside it; `@register(name, summary=...)` on the class puts it in
`DECODERS`. Every module in `fastforward.decoding.decoders` is imported on first lookup, so a new method
is one new file. Knobs with the same name are one knob (one CLI flag): decoders share the declarations
below (`BLOCK_SIZE.field()`, or `GAMMA.field(0.1)` at a default of their own); `sampling()` offers a
decoder's `sampler` as --temperature, --top-p and --seed, `reveal_policy()` its `policy` as --policy and
--gamma. Construction checks every value (`Decoder.__post_init__`), however the decoder is made.
Decoders are `@dataclass(eq=False)`: compared by identity, and hashable, as plain objects are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, TypeVar

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.policies import POLICIES, make_policy
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.options import NON_NEGATIVE, POSITIVE, Knob, built_from, knobs_of, value_of
from fastforward.registry import Registry


@dataclass(frozen=True)
class DecoderSpec:
    """A registered decoder: its class, its knobs (read from the class's fields), and what it promises."""

    name: str
    cls: type[Decoder]
    knobs: tuple[Knob, ...]
    summary: str
    lossless: bool = False  # output equals AR decoding of the same model (greedy, or sampled with the same seed)
    needs_mask: bool = False  # needs a model trained with a mask token

    def knob(self, name: str) -> Knob | None:
        return next((k for k in self.knobs if k.name == name), None)

    def create(self, **values: Any) -> Decoder:
        """The decoder with these knob values (the rest at their defaults), errors naming CLI flags."""
        return self.make(values)

    def make(self, values: dict[str, Any], label: Callable[[Knob], str] = lambda knob: knob.flag) -> Decoder:
        """The decoder with these knob values (the rest at their defaults).

        A knob the decoder does not take is accepted only at its neutral default (so one set of
        options can serve several decoders); any other value, and any bad value, raises, naming
        each knob by `label` (its CLI flag; the server passes its JSON field name). The decoder's
        own construction checks the values again, and the rules between them.
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
        return self.cls(**{f.name: value_of(f, chosen) for f in fields(self.cls) if knobs_of(f)})


DECODERS: Registry[DecoderSpec] = Registry("decoder", "fastforward.decoding.decoders")
_KNOBS: dict[str, Knob] = {}
Kind = TypeVar("Kind", bound=type[Decoder])


def register(name: str, *, summary: str, lossless: bool = False, needs_mask: bool = False) -> Callable[[Kind], Kind]:
    """Declare a decoder under `name`; decorates its class, a dataclass whose option fields are its knobs."""

    def decorate(cls: Kind) -> Kind:
        if not is_dataclass(cls):
            raise TypeError(f"decoder {name!r}: register a dataclass, whose option fields are its knobs")
        cls.name = name
        knobs = tuple(knob for f in fields(cls) for knob in knobs_of(f))
        for knob in knobs:
            known = _KNOBS.setdefault(knob.name, knob)
            if replace(known, default=knob.default) != knob:
                raise TypeError(f"decoder {name!r} declares knob {knob.name!r} unlike an earlier declaration")
        DECODERS.add(name, DecoderSpec(name, cls, knobs, summary, lossless, needs_mask), cls.__module__)
        return cls

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
        allowed = f" One of {', '.join(k.choices)}." if k.choices else (f" Must be {k.bound.rule}." if k.bound else "")
        lines.append(f"| `{k.flag}` | {k.help}.{allowed} |")
    return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


# ---- knobs shared by several decoders ------------------------------------------------------------
BLOCK_SIZE = Knob("block_size", int, 16, "tokens per block (masks or drafts)", bound=POSITIVE)
POLICY = Knob("policy", str, "entropy", "reveal policy: which masked positions a forward fills", tuple(POLICIES))
GAMMA = Knob(
    "gamma",
    float,
    0.35,
    "the policy's bound: entropy or confidence budget γ, factor f, or threshold τ",
    bound=NON_NEGATIVE,
)
FIRST_TOKEN_FROM_NTP = Knob(
    "first_token_from_ntp",
    bool,
    False,
    "take the first masked position's token from the next-token prediction (sbd: each block's first; "
    "setdlm: every step's, then the run of confident positions after it)",
)
SAMPLING = tuple(knob for f in fields(Sampler) for knob in knobs_of(f))  # temperature, top_p, seed


def sampling() -> Any:
    """A decoder's `sampler` field (greedy by default), offered as --temperature, --top-p and --seed."""
    return built_from(SAMPLING, Sampler)


def reveal_policy() -> Any:
    """A decoder's `policy` field (entropy-bounded, γ = 0.35, by default), offered as --policy and --gamma."""
    return built_from((POLICY, GAMMA), lambda policy, gamma: make_policy(policy, gamma))
