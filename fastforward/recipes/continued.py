"""`fastforward recipe ... --from MODEL`: a recipe run that continues a shipped model's training (and the
check of `--start`'s adapter, the model a first version trains from).

A long training becomes a chain of shipped versions, each one usable: every version is one adapter over the
base (the shipped adapter, flattened from SFT and the method's stage, trained further as a whole with a fresh
optimizer and a short warm-up), its provenance holds the one it continued (`provenance.json`'s `start`, and so
on down the chain: the commands that made each), and its learning curve counts on from the tokens the
versions before it trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastforward.errors import FastForwardError
from fastforward.model import adapters
from fastforward.model.presets import resolve_model_path

SHIPPED_RECORD = "provenance.json"  # what `Recipe.ship` writes beside a shipped adapter


def continuation(name: str, base: str, objective: str) -> dict[str, Any]:
    """What a plan records of the model `name` (a preset or folder) that a run continues: its adapter folder,
    rank, and the method-stage tokens behind it. Refused unless it is an adapter over `base` made by the same
    objective (a recipe of another method post-trains a model with its own start, e.g. MultiTF's --start)."""
    try:
        folder = resolve_model_path(name)
    except FastForwardError as exc:
        raise FastForwardError(f"--from {name}: {exc}") from exc
    if not adapters.is_adapter(folder):
        raise FastForwardError(
            f"--from {name}: {folder} is not an adapter folder; give a model a recipe shipped (its --ship-to "
            "folder or a preset name)"
        )
    adapters.check_adapter(folder)
    named = adapters.base_of(folder)
    if named is None or _resolved(named) != _resolved(base):
        raise FastForwardError(f"--from {name} is an adapter over {named}, not over --model {base}")
    made_by = _objective_of(folder)
    if made_by not in (None, objective):
        raise FastForwardError(
            f"--from {name} was trained with {made_by}, not {objective}: continue it with its own recipe"
        )
    return {
        "adapter": str(folder),
        "name": name,
        "rank": int(adapters.read_config(folder)["r"]),
        "tokens_before": tokens_behind(_shipped_record(folder)),
    }


def start_adapter(name: str, base: str) -> Path:
    """The adapter folder `--start` names (a preset or folder), refused unless it is an adapter over `base`."""
    try:
        folder = resolve_model_path(name)
    except FastForwardError as exc:
        raise FastForwardError(f"--start {name}: {exc}") from exc
    if not adapters.is_adapter(folder):
        raise FastForwardError(f"--start {name}: {folder} is not an adapter folder; give one over --model {base}")
    adapters.check_adapter(folder)
    named = adapters.base_of(folder)
    if named is not None and _resolved(named) != _resolved(base):
        raise FastForwardError(f"--start {name} is an adapter over {named}, not over --model {base}")
    return folder


def tokens_behind(record: dict[str, Any]) -> float:
    """The method-stage tokens a shipped model's chain trained: its curve's last point (which counts those of
    the versions before it); 0 for a model shipped without a record of them."""
    curve = (record.get("dev") or {}).get("curve") or []
    return float(curve[-1]["tokens"]) if curve else 0.0


def _shipped_record(folder: Path) -> dict[str, Any]:
    path = folder / SHIPPED_RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def _objective_of(folder: Path) -> str | None:
    """The objective an adapter's own provenance names (a flattened one: its last stage's)."""
    path = folder / adapters.PROVENANCE
    if not path.is_file():
        return None
    objective = json.loads(path.read_text()).get("objective")
    return objective.get("name") if isinstance(objective, dict) else objective


def _resolved(name: str) -> Path:
    try:
        return resolve_model_path(name).resolve()
    except FastForwardError:
        return Path(name)
