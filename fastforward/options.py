"""Options declared once, as dataclass fields, for decoders, objectives, tasks and the policies and
samplers decoders are built from: a field users set by name (a CLI flag, a task option, a server request
field, a keyword argument) carries its help and the rule its values obey, beside its default.

`option(default, help, bound, choices)` declares one field; a `Knob` is that declaration read back with
its name (`knobs_of`, `options_of`), which is what the CLI flags, the server's fields, sweeps and the docs
table are made from. A field may also be built from several knobs (`built_from`): a decoder's `sampler`
is offered as `--temperature`, `--top-p` and `--seed`. `check_options` (from the class's `__post_init__`)
holds an instance to its fields' rules, so a value is refused alike however the object is made; rules
between options stay in the class's own `__post_init__`, after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any

from fastforward.errors import FastForwardError

_OFFER = "fastforward.offer"  # the metadata key of a field's `_Offer`
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True)
class Bound:
    """A rule an option's values obey, with the rule in words for error messages and the docs."""

    rule: str  # "> 0", "in (0, 1]"
    holds: Callable[[Any], bool] = field(compare=False)


def at_least(low: float) -> Bound:
    return Bound(f">= {low}", lambda v: v >= low)


def within(low: float, high: float) -> Bound:
    """Between `low` and `high`, both allowed."""
    return Bound(f"in [{low}, {high}]", lambda v: low <= v <= high)


# Comparisons are false for NaN, so every bound refuses it.
POSITIVE = Bound("> 0", lambda v: v > 0)
NON_NEGATIVE = at_least(0)
AT_LEAST_ONE = at_least(1)
FRACTION = within(0, 1)  # shares and probabilities
SHARE = Bound("in (0, 1]", lambda v: 0 < v <= 1)  # a share that cannot be nothing
PROPER_FRACTION = Bound("in (0, 1)", lambda v: 0 < v < 1)  # a share that is neither nothing nor all


@dataclass(frozen=True)
class Knob:
    """One option users set by name: its type, default, help, and what its values must be."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    bound: Bound | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def field(self, default: Any = MISSING) -> Any:
        """A dataclass field offered as this knob, at `default` where given (else the knob's)."""
        value = self.default if default is MISSING else default
        return field(default=value, metadata={_OFFER: _Offer((replace(self, default=value),))})

    def parse(self, text: str, label: str | None = None) -> Any:
        """A value from command-line text (sweeps, task options), validated; `label`: how errors name the
        knob (default: its flag)."""
        label = label or self.flag
        try:
            value = _BOOLS[text.strip().lower()] if self.type is bool else self.type(text.strip())
        except (KeyError, ValueError):
            raise FastForwardError(f"{label} takes {self.type.__name__} values, got {text!r}") from None
        return self.validate(value, label)

    def validate(self, value: Any, label: str | None = None) -> Any:
        """The value, if allowed; `label`: how errors name the knob where the caller has its own word
        for it (its CLI flag, the server's JSON field)."""
        words = self.name.replace("_", " ")
        if self.choices is not None and value not in self.choices:
            choices = ", ".join(self.choices)
            raise FastForwardError(f"{label or words}: unknown value {value!r}; choose one of {choices}")
        if self.bound is not None and not self.bound.holds(value):
            where = f" ({label})" if label else ""
            raise FastForwardError(f"{words} must be {self.bound.rule}, got {value}{where}")
        return value


@dataclass(frozen=True)
class _Offer:
    """How a field is offered to users: as `knobs`, its value `build(**their values)`; without `build`,
    the one knob's value is the field's (and a knob without a name is named after the field)."""

    knobs: tuple[Knob, ...]
    build: Callable[..., Any] | None = None


def option(
    default: Any,
    help: str,
    bound: Bound | None = None,
    choices: tuple[str, ...] | None = None,
    name: str = "",
    kind: type | None = None,
) -> Any:
    """A dataclass field users set by name, with its help and the rule its values obey (`name`: the
    knob's, where users know it by another name than the field's; `kind`: the values' type, where the
    default does not tell it: a default of None, or `MISSING` for a field that must be given)."""
    return Knob(name, kind or type(default), default, help, choices, bound).field()


def built_from(knobs: tuple[Knob, ...], build: Callable[..., Any]) -> Any:
    """A dataclass field whose value `build(**values)` is made from the values of several knobs (its
    default from theirs)."""
    return field(default=build(**{k.name: k.default for k in knobs}), metadata={_OFFER: _Offer(tuple(knobs), build)})


def knobs_of(f: Field) -> tuple[Knob, ...]:
    """The knobs a dataclass field is offered as (none: the field is no option)."""
    offer: _Offer | None = f.metadata.get(_OFFER)
    if offer is None:
        return ()
    if offer.build is None:
        (knob,) = offer.knobs
        return (replace(knob, name=knob.name or f.name),)
    return offer.knobs


def options_of(cls: type) -> dict[str, Knob]:
    """The options a dataclass takes, by field name: each field set at construction that is offered as
    one knob (a field built from several knobs is set through them, see `built_from`)."""
    found = {}
    for f in fields(cls):
        knobs = knobs_of(f)
        if f.init and len(knobs) == 1 and f.metadata[_OFFER].build is None:
            found[f.name] = knobs[0]
    return found


def value_of(f: Field, values: Mapping[str, Any]) -> Any:
    """The value of an option field from its knobs' values (by knob name)."""
    knobs, build = knobs_of(f), f.metadata[_OFFER].build
    return values[knobs[0].name] if build is None else build(**{k.name: values[k.name] for k in knobs})


def check_options(instance: Any) -> None:
    """Refuse an option field's value outside its rule (a built field checks itself, or is the
    caller's own object)."""
    for f in fields(instance):
        offer: _Offer | None = f.metadata.get(_OFFER)
        if offer is not None and offer.build is None:
            knobs_of(f)[0].validate(getattr(instance, f.name))
