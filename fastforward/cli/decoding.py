"""Decoder flags shared by every command that decodes, generated from the decoder registry."""

from __future__ import annotations

import argparse
from typing import Any

from fastforward.cli import add_command
from fastforward.decoding.decoders import registry


def add_decoder_flags(
    p: argparse.ArgumentParser, default: str | None = "ar", skip: tuple[str, ...] = (), default_help: str = ""
) -> None:
    """`--decoder` and one flag per registry knob (except `skip`). A flag left out takes the chosen
    decoder's own default; a flag the chosen decoder does not take is an error unless neutral.
    default None: the command picks one itself (and says how in `default_help`)."""
    specs = registry.specs()
    p.add_argument(
        "--decoder", choices=list(specs), default=default, help=f"decoding method (default: {default_help or default})"
    )
    for knob in registry.all_knobs().values():
        if knob.name in skip:
            continue
        users = [s for s in specs.values() if s.knob(knob.name)]
        defaults = {str(s.knob(knob.name).default) for s in users}
        where = ", ".join(s.name for s in users)
        text = f"{knob.help} [{where}; default {' / '.join(sorted(defaults))}]"
        if knob.type is bool:
            p.add_argument(knob.flag, action="store_true", default=argparse.SUPPRESS, help=text)
        else:
            p.add_argument(knob.flag, type=knob.type, default=argparse.SUPPRESS, metavar=knob.name.upper(), help=text)


def decoder_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The knob values given on the command line (those left out are absent)."""
    knobs = registry.all_knobs()
    return {name: value for name, value in vars(args).items() if name in knobs}


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "decoders")
    p.set_defaults(run=lambda args: print(registry.knob_table()) or 0)
