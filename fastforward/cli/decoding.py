"""Decoder flags shared by every command that decodes, generated from the decoder registry."""

from __future__ import annotations

import argparse
from typing import Any

from fastforward.cli import add_command
from fastforward.decoding.decoders import registry
from fastforward.decoding.model_defaults import DecodingDefaults, model_decoding_defaults
from fastforward.errors import FastForwardError


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


def chosen_decoder(
    args: argparse.Namespace, knobs: dict[str, Any], fallback: str, cwd: str = "."
) -> tuple[str, dict[str, Any]]:
    """The decoder and options a command line asks for: --decoder with the options given (`knobs`); without
    it, the model's own default (its --adapter's decoding.json, else its --model's) or `fallback`, with the
    options given over the default's (`default_decoder`). `cwd`: where relative paths lead."""
    if args.decoder is not None:
        return args.decoder, knobs
    return default_decoder(knobs, model_decoding_defaults(args.model, args.adapter, cwd), fallback)


def default_decoder(
    knobs: dict[str, Any], defaults: DecodingDefaults | None, fallback: str
) -> tuple[str, dict[str, Any]]:
    """The decoder, and its options, of a command line that names no decoder: the model's own default
    (`defaults`, from its decoding.json), else the command's (`fallback`); options given override the
    default's. One given that the default decoder does not take is an error naming that decoder, the one
    the user gets, and the decoders that take it: no other decoder could stand in for it silently."""
    chosen = defaults or DecodingDefaults(fallback)
    whose = "this model's default (its decoding.json)" if defaults else "the default"
    spec, known = registry.spec(chosen.decoder), registry.all_knobs()
    for name, value in knobs.items():
        if spec.knob(name) is None and value != known[name].default:
            takers = ", ".join(s.name for s in registry.specs().values() if s.knob(name))
            raise FastForwardError(
                f"{known[name].flag} {value} does not apply to the {spec.name!r} decoder, {whose}; "
                f"choose a decoder that takes it with --decoder ({takers})"
            )
    return chosen.decoder, {**chosen.options, **knobs}


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "decoders")
    p.set_defaults(run=lambda args: print(registry.knob_table()) or 0)
