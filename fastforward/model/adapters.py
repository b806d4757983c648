"""LoRA adapters the way the field ships them: a PEFT adapter directory, merged into the weights at load.

A directory is an adapter when it holds PEFT's `adapter_config.json`. fastforward writes one more
file beside it, `fastforward_adapter.json` (provenance: the base it was trained on, the objective, the
steps), and the tokenizer when training gave it a token the base lacks (the mask token). An adapter made
by `peft` itself loads too: its base is then the config's `base_model_name_or_path`, or the model the
caller names.

The adapter is merged into the base's weights before anything else happens to them (quantization,
compiling), so a merged model decodes at exactly the cost of the base; except before int4
quantization, which would round a merged update back onto the base's grid: there its linear layers'
updates are taken out (`split`) and kept beside the quantized weights (`fastforward.cpu.low_rank`).
Chains work: an adapter's base may itself be an adapter directory (a second Jacobi Forcing round
trained on top of the first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from fastforward.cpu.low_rank import LowRank, add_update
from fastforward.errors import FastForwardError
from fastforward.shipped import ADAPTER_CONFIG, is_adapter  # free of torch: `fastforward models` lists adapters

PROVENANCE = "fastforward_adapter.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
DEFAULT_TARGETS = "all-linear"  # PEFT's name for every linear layer but the output projection


def _read(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FastForwardError(f"{path} is unreadable or not JSON ({exc}); the adapter is damaged") from exc
    if not isinstance(value, dict):
        raise FastForwardError(f"{path} is not a JSON object; the adapter is damaged")
    return value


def read_config(adapter: Path) -> dict:
    """The adapter's PEFT configuration (rank, alpha, target modules...)."""
    return _read(adapter / ADAPTER_CONFIG)


def weights_file(adapter: Path) -> Path:
    """The adapter's weights (safetensors preferred), or a one-line error naming what is missing."""
    for name in WEIGHTS:
        if (adapter / name).is_file():
            return adapter / name
    raise FastForwardError(f"adapter {adapter} has no weights ({' or '.join(WEIGHTS)}); it is incomplete")


def training_folder(path: str | Path) -> str:
    """A local folder as a provenance record keeps it, e.g. `sft (a training folder)`: its own name says
    what it was, and the path it had on the machine that made it says nothing anywhere else."""
    return f"{Path(path).name} (a training folder)"


def path_free(reference: str) -> str:
    """A model an adapter was made from, as a shipped record keeps it: a local folder (absolute, as training
    records one, or there) by `training_folder`; a name (a preset, a Hub id) as it is."""
    path = Path(reference).expanduser()
    return training_folder(path) if path.is_absolute() or path.exists() else reference


def base_of(adapter: Path) -> str | None:
    """The base an adapter names: fastforward's provenance first, then PEFT's `base_model_name_or_path`."""
    provenance = adapter / PROVENANCE
    if provenance.is_file() and (base := _read(provenance).get("base")):
        return str(base)
    return read_config(adapter).get("base_model_name_or_path") or None


def resolve_chain(path: Path, resolve: Callable[[str], Path]) -> tuple[Path, list[Path]]:
    """(the full model underneath, the adapters to merge into it, first to last) for a model path.

    `resolve` turns the name an adapter gives of its base into a local path (presets included).
    """
    chain: list[Path] = []
    while is_adapter(path):
        if path.resolve() in (p.resolve() for p in chain):
            raise FastForwardError(f"adapter {path} is its own base (a loop in {PROVENANCE})")
        chain.insert(0, path)
        named = base_of(path)
        if named is None:
            raise FastForwardError(f"adapter {path} names no base model; give it with --model BASE --adapter {path}")
        try:
            path = resolve(named)
        except FastForwardError as exc:  # a Hub id, a folder on another machine
            raise FastForwardError(
                f"adapter {path} names its base {named!r}, which cannot be loaded here ({exc}); "
                f"give the base with --model BASE --adapter {path}"
            ) from exc
    return path, chain


def check_adapter(path: Path) -> Path:
    """`path` if it is an adapter directory with weights, else a one-line error saying what it is not."""
    if not path.is_dir():
        raise FastForwardError(f"adapter {path} does not exist or is not a directory")
    if not (path / ADAPTER_CONFIG).is_file():
        raise FastForwardError(f"{path} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    weights_file(path)
    return path


def has_tokenizer(adapter: Path) -> bool:
    """Whether the adapter carries its own tokenizer (written when training added a token to the base's)."""
    return (adapter / "tokenizer_config.json").is_file()


def digest(adapters: list[Path]) -> str:
    """SHA-256 over every adapter's configuration and weights: part of the quantized store's key."""
    h = hashlib.sha256()
    for adapter in adapters:
        for file in (adapter / ADAPTER_CONFIG, weights_file(adapter)):
            h.update(file.read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Hide a FutureWarning that PEFT's own calls into transformers raise (`is_gradient_checkpointing`):
    nothing a user of fastforward can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def merge(hf: PreTrainedModel, adapter: Path) -> PreTrainedModel:
    """`hf` with the adapter's low-rank updates added into its weights (PEFT's merge_and_unload)."""
    return split(hf, adapter, keep_apart=False)[0]


def split(hf: PreTrainedModel, adapter: Path, keep_apart: bool = True) -> tuple[PreTrainedModel, dict[str, LowRank]]:
    """`hf` with the adapter merged, except (keep_apart) the plain LoRA updates of its `nn.Linear` layers,
    which are returned by layer name instead, to be kept beside quantized weights. The rest (LoRA on
    embeddings, DoRA, fan-in-fan-out layers, fully trained modules) is merged as PEFT merges it."""
    weights_file(adapter)
    read_config(adapter)
    from peft import PeftModel  # imported by adapters only: peft's import costs a second

    try:
        with quiet_peft():
            wrapped = PeftModel.from_pretrained(hf, str(adapter))
            updates = _take_linear_updates(wrapped) if keep_apart else {}
            merged = wrapped.merge_and_unload()
    except (ValueError, RuntimeError, KeyError) as exc:  # size mismatches, target modules not found
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FastForwardError(
            f"adapter {adapter} does not fit this base model ({first}); load it on the base it was trained on "
            f"(see {PROVENANCE} or {ADAPTER_CONFIG})"
        ) from exc
    return merged, updates


def _take_linear_updates(wrapped) -> dict[str, LowRank]:
    """The plain LoRA updates of the `nn.Linear` layers of a PeftModel, by the layer's name in the bare
    model; each is zeroed in the PeftModel, so that merging it afterwards leaves those weights as they were."""
    from peft.tuners.lora import Linear as LoraLinear

    updates: dict[str, LowRank] = {}
    for name, module in wrapped.base_model.model.named_modules():
        if type(module) is not LoraLinear or module.fan_in_fan_out or not isinstance(module.base_layer, nn.Linear):
            continue
        for key in module.active_adapters:
            if key not in module.lora_A or module.use_dora.get(key, False) or module.lora_B[key].bias is not None:
                continue  # merged as PEFT merges it
            down, up = module.lora_A[key].weight, module.lora_B[key].weight
            add_update(updates, name, LowRank(down, up.detach().float() * module.scaling[key]))
            with torch.no_grad():
                up.zero_()
    return updates


def lora_config(rank: int, alpha: float | None = None, targets: str | list[str] = DEFAULT_TARGETS):
    """PEFT's LoraConfig for a causal LM: `targets` is "all-linear", comma-separated module names, or a list
    of the modules' full names."""
    if rank < 1:
        raise FastForwardError(f"the LoRA rank must be at least 1, got {rank}")
    from peft import LoraConfig

    if isinstance(targets, list):
        modules: str | list[str] = targets
    else:
        modules = targets if targets == DEFAULT_TARGETS else [t for t in targets.split(",") if t]
    if not modules:
        raise FastForwardError("--lora-targets is empty; give module names such as q_proj,v_proj or all-linear")
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        target_modules=modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
