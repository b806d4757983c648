"""A chain of LoRA adapters (a base, an SFT adapter over it, a Jacobi Forcing adapter over that) as one.

Adapters trained in turn stack: each update sB·A is added to the weights the next one was trained on,
so the chain's update of a layer is the sum of theirs. That sum is itself a LoRA update of the summed
rank: A is the adapters' A matrices stacked, B their scaled B matrices side by side (scale 1). One
adapter ships as one directory, loads without its intermediate steps, and, kept beside int4 weights,
costs one low-rank product rather than one per adapter. Stored in bfloat16 it is half the bytes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fastforward.errors import FastForwardError
from fastforward.model import adapters

LORA_KEYS = (".lora_A.weight", ".lora_B.weight")
PEFT_PREFIX = "base_model.model."  # what PEFT's saved keys put before a module's name in the model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _scale(config: dict, adapter: Path) -> float:
    """The factor PEFT multiplies B·A by: alpha / r (alpha / √r with rsLoRA)."""
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise FastForwardError(f"adapter {adapter}: per-layer ranks, alphas or DoRA cannot be flattened")
    if config.get("modules_to_save"):
        raise FastForwardError(f"adapter {adapter} trains whole modules ({config['modules_to_save']}), not LoRA only")
    rank = int(config["r"])
    return float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _updates(adapter: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted module's (A, scaled B), by the module's key prefix in PEFT's state dict."""
    scale = _scale(adapters.read_config(adapter), adapter)
    weights = load_file(adapters.weights_file(adapter))
    modules = {k.removesuffix(LORA_KEYS[0]) for k in weights if k.endswith(LORA_KEYS[0])}
    unknown = sorted(k for k in weights if not k.endswith(LORA_KEYS))
    if unknown:
        raise FastForwardError(f"adapter {adapter} holds more than LoRA linear updates (e.g. {unknown[0]})")
    return {m: (weights[m + LORA_KEYS[0]].float(), weights[m + LORA_KEYS[1]].float() * scale) for m in modules}


def flatten(chain: list[Path], out: Path, base: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the adapters of `chain` (first to last, each trained over the one before) to `out` as one
    LoRA adapter over `base` (the model under the first), its weights in `dtype`; returns `out`."""
    if not chain:
        raise FastForwardError("no adapters to flatten")
    each = [_updates(adapters.check_adapter(a)) for a in chain]
    ranks = [int(adapters.read_config(a)["r"]) for a in chain]
    tensors: dict[str, torch.Tensor] = {}
    for module in sorted(set().union(*each)):
        down, up = next(u[module] for u in each if module in u)
        pairs = [  # zeros where an adapter left the module out
            u[module] if module in u else (down.new_zeros(r, down.shape[1]), up.new_zeros(up.shape[0], r))
            for u, r in zip(each, ranks, strict=True)
        ]
        tensors[module + LORA_KEYS[0]] = torch.cat([a for a, _ in pairs]).to(dtype).contiguous()
        tensors[module + LORA_KEYS[1]] = torch.cat([b for _, b in pairs], dim=1).to(dtype).contiguous()

    rank = sum(ranks)
    # each adapted module by its full name: a chain that left layers out (`--lora-layers`) loads with none added
    targets = sorted(m.removeprefix(PEFT_PREFIX) for m in set().union(*each))
    config = adapters.read_config(chain[-1])
    config.update(r=rank, lora_alpha=rank, use_rslora=False, target_modules=targets, base_model_name_or_path=base)
    provenance = {
        "base": base,
        "flattened": [_provenance(a) for a in chain],
        "objective": _provenance(chain[-1]).get("objective"),
        "dtype": str(dtype).removeprefix("torch."),
    }
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / adapters.WEIGHTS[0])
    (tmp / adapters.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (tmp / adapters.PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    tokenizer = next((a for a in reversed(chain) if adapters.has_tokenizer(a)), None)
    for name in TOKENIZER_FILES if tokenizer else ():
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _provenance(adapter: Path) -> dict:
    """An adapter's provenance as the flattened adapter keeps it: free of paths (`adapters.path_free`), for
    what a chain flattens into is what ships; the base of the whole is the caller's `base`."""
    path = adapter / adapters.PROVENANCE
    if not path.is_file():
        return {"adapter": adapters.training_folder(adapter)}
    record = json.loads(path.read_text())
    if record.get("base"):
        record["base"] = adapters.path_free(str(record["base"]))
    if (record.get("train") or {}).get("lora_from"):
        record["train"] = {**record["train"], "lora_from": adapters.training_folder(record["train"]["lora_from"])}
    return record
