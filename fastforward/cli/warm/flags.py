"""`generate`'s flags as data, so that its client parses a command line as `generate` does without
importing torch (the decoder flags come from the decoder registry, the precision flags' choices from
the model package: both import it).

The engine, which has them loaded, describes `generate`'s parser (`GenerateFlags.of`) and writes the
description in its state; the client rebuilds the parser from it (`GenerateFlags.parse`): the same
options, actions, types, choices and defaults, hence the same parse (abbreviations, `--flag=value`,
errors). A command line that does not parse is left to the client's own process, where argparse says
what is wrong.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastforward.cli import fill_device_defaults, positive_int

TYPES = {"int": int, "float": float, "str": str, "positive_int": positive_int}
KINDS = {
    argparse._HelpAction: "help",
    argparse._StoreAction: "store",
    argparse._AppendAction: "append",
    argparse._StoreTrueAction: "store_true",
    argparse.BooleanOptionalAction: "boolean",
}
ACTIONS = {
    "help": "store_true",
    "store": "store",
    "append": "append",
    "store_true": "store_true",
    "boolean": argparse.BooleanOptionalAction,
}


class _Parser(argparse.ArgumentParser):
    """Raises instead of printing usage and exiting: the client's own process reports the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


@dataclass(frozen=True)
class GenerateFlags:
    """`generate`'s parser as data: its `actions`, which of them are decoder options (`knobs`), and the
    values --dtype, --quantize and --exact take when left unset, on "cpu" and on "cuda" (`device_defaults`)."""

    actions: tuple[Mapping[str, Any], ...]
    knobs: tuple[str, ...]
    device_defaults: Mapping[str, Mapping[str, Any]]

    @classmethod
    def of(
        cls, parser: argparse.ArgumentParser, knobs: tuple[str, ...], device_defaults: Mapping[str, Mapping[str, Any]]
    ) -> GenerateFlags:
        return cls(tuple(_described(action) for action in parser._actions), knobs, device_defaults)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GenerateFlags:
        return cls(tuple(data["actions"]), tuple(data["knobs"]), data["device_defaults"])

    def as_json(self) -> dict[str, Any]:
        return {"actions": list(self.actions), "knobs": list(self.knobs), "device_defaults": self.device_defaults}

    def parser(self) -> argparse.ArgumentParser:
        """`generate`'s parser, rebuilt (its -h/--help a plain switch: the client leaves help to its process)."""
        p = _Parser(prog="fastforward generate", add_help=False)
        for a in self.actions:
            default = argparse.SUPPRESS if a["suppressed"] else a["default"]
            options: dict[str, Any] = {"action": ACTIONS[a["kind"]], "default": default}
            if a["kind"] in ("store", "append"):
                options.update(nargs=a["nargs"], type=a["type"] and TYPES[a["type"]], choices=a["choices"])
            if a["flags"]:
                p.add_argument(*a["flags"][:1] if a["kind"] == "boolean" else a["flags"], dest=a["dest"], **options)
            else:
                p.add_argument(a["dest"], **options)
        return p

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """`generate ARGV` (argv: the words after `generate`) as `generate` parses it, its precision flags
        resolved for its device; ValueError when it does not parse."""
        args = self.parser().parse_args(argv)
        fill_device_defaults(args, self.device_defaults)
        return args

    def options(self, args: argparse.Namespace) -> dict[str, Any]:
        """The decoder options a parsed command line gives (those left out are absent)."""
        return {name: value for name, value in vars(args).items() if name in self.knobs}


def _described(action: argparse.Action) -> dict[str, Any]:
    kind = KINDS[type(action)]  # a kind of action not described here: the engine refuses to start
    if action.type is not None and action.type.__name__ not in TYPES:
        raise TypeError(f"generate's {action.dest}: type {action.type.__name__} is not one the client rebuilds")
    suppressed = action.default is argparse.SUPPRESS
    return {
        "flags": list(action.option_strings),
        "dest": action.dest,
        "kind": kind,
        "nargs": action.nargs,
        "type": action.type and action.type.__name__,
        "choices": list(action.choices) if action.choices is not None else None,
        "default": None if suppressed else action.default,
        "suppressed": suppressed,
    }
