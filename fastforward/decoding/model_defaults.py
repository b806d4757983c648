"""A model's decoding defaults: the decoder, and its options, that the model's recipe measured fastest,
kept beside its weights in `decoding.json`, so that `generate`, `serve`, the warm engine and the demo
decode it so when the user names no decoder:

    {"decoder": "jacobi", "options": {"block_size": 8}, "measured": "what figure chose it, and its command"}

Any model or adapter directory may hold one (shipped adapters and demo checkpoints do where their
figures justify it); a model without one gets the command's own default. Free of torch: the decoders
(and torch with them) are imported only to check a file's decoder and options.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastforward.errors import FastForwardError
from fastforward.shipped import PRESETS, shipped_directory

FILE = "decoding.json"
FIELDS = ("decoder", "options", "measured")


@dataclass(frozen=True)
class DecodingDefaults:
    """The decoder a model decodes with when none is named, its options (knob name: value), and the
    measurement that chose them (one line: the figure, and the command that gives it)."""

    decoder: str
    options: Mapping[str, Any] = field(default_factory=dict)
    measured: str = ""

    def describe(self) -> str:
        """As a command line asks for it, e.g. `jacobi --block-size 8` (an option that is on: its flag alone)."""
        words = [self.decoder]
        for name, value in self.options.items():
            flag = "--" + name.replace("_", "-")
            words += [flag] if value is True else [] if value is False else [flag, str(_json_value(value))]
        return " ".join(words)

    def as_json(self) -> dict[str, Any]:
        return {
            "decoder": self.decoder,
            "options": {name: _json_value(value) for name, value in self.options.items()},
            "measured": self.measured,
        }


def read_decoding_defaults(directory: Path, *, check: bool = True) -> DecodingDefaults | None:
    """The defaults `directory/decoding.json` records (None: it has none). A malformed file is a one-line
    error; `check` also holds its decoder and options to the decoder registry (which imports torch: a
    listing that only shows them leaves it out)."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _bad(path, f"it is not readable JSON ({exc})") from exc
    if not isinstance(record, dict):
        raise _bad(path, f"a JSON {type(record).__name__}, not an object")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise _bad(path, f"unknown field(s) {', '.join(unknown)}; its fields are {', '.join(FIELDS)}")
    decoder, options, measured = record.get("decoder"), record.get("options", {}), record.get("measured", "")
    if not isinstance(decoder, str):
        raise _bad(path, f'"decoder" must name a decoder, got {decoder!r}')
    if not isinstance(options, dict) or not isinstance(measured, str):
        raise _bad(path, '"options" must be an object of decoder options and "measured" a line of text')
    defaults = DecodingDefaults(decoder, options, measured)
    return _checked(defaults, path) if check else defaults


def write_decoding_defaults(directory: Path, defaults: DecodingDefaults) -> Path:
    """Write `directory/decoding.json` (checked first; atomic: a reader never sees half a file)."""
    path = Path(directory) / FILE
    _checked(defaults, path)
    tmp = path.with_name(f".{FILE}.tmp")
    tmp.write_text(json.dumps(defaults.as_json(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _checked(defaults: DecodingDefaults, path: Path) -> DecodingDefaults:
    """`defaults` with its option values typed, once the registry takes its decoder and options (each one
    the decoder's own, each value within its bounds, the decoder constructible from them)."""
    from fastforward.decoding.decoders import registry  # every decoder, and torch

    try:
        spec = registry.spec(defaults.decoder)
        values = {}
        for name, value in defaults.options.items():
            knob = spec.knob(name)
            if knob is None:
                own = ", ".join(k.name for k in spec.knobs) or "none"
                raise FastForwardError(f"the {spec.name!r} decoder takes no option {name!r} (its options: {own})")
            values[name] = _typed(knob, value)
        spec.make(values, label=lambda knob: f"option {knob.name!r}")
    except FastForwardError as exc:
        raise _bad(path, str(exc)) from exc
    return DecodingDefaults(defaults.decoder, values, defaults.measured)


def model_decoding_defaults(model: str, adapter: str | None = None, cwd: str = ".") -> DecodingDefaults | None:
    """The defaults of the model a `--model` (and `--adapter`) names: the adapter's decoding.json, else the
    model's; None when neither has one (a preset, a GGUF file, a directory without the file: the command's
    own default). Relative paths are taken from `cwd`; a name that leads nowhere has none (loading it says
    what is wrong)."""
    for name in (adapter, model):
        directory = _directory(name, cwd) if name else None
        found = read_decoding_defaults(directory) if directory else None
        if found is not None:
            return found
    return None


def _directory(name: str, cwd: str) -> Path | None:
    """The directory a model name leads to, as `fastforward.model.resolve_model_path` finds it, without
    converting a preset (None: a preset, a GGUF file, nothing)."""
    if name in PRESETS:
        return None
    path = Path(cwd) / Path(name).expanduser()
    return shipped_directory(name) or (path if path.is_dir() else None)


def _typed(knob: Any, value: Any) -> Any:
    """A JSON value as the knob's type; text as on a command line (`"inf"`), for the knobs that take no text."""
    if isinstance(value, str) and knob.type is not str:
        return knob.parse(value)
    if knob.type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not knob.type:
        raise FastForwardError(f"option {knob.name!r} takes {knob.type.__name__} values, got {value!r}")
    return value


def _json_value(value: Any) -> Any:
    """A value as JSON and a command line write it: infinity as "inf" (strict JSON has no Infinity)."""
    return ("inf" if value > 0 else "-inf") if isinstance(value, float) and math.isinf(value) else value


def _bad(path: Path, problem: str) -> FastForwardError:
    return FastForwardError(f"{path}: {problem}; fix the file or remove it (the command's own default then applies)")
