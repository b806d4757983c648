"""A LoRA run's model: PEFT LoRA layers added before training, taken off again if the run fails.

The trainer saves the adapter itself (`run_dir.save_final`); loading and merging are in
`fastforward.model.adapters`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.pytorch_utils import Conv1D

from fastforward.errors import FastForwardError
from fastforward.model import Model, adapters
from fastforward.training.data import derive_seed

LINEAR = (torch.nn.Linear, Conv1D)  # what PEFT's "all-linear" adapts (GPT-2's projections are Conv1D)


def wrap(model: Model, rank: int, alpha: float, targets: str, seed: int, start: str = "", top_layers: int = 0) -> None:
    """Freeze the model and give it LoRA layers of `rank` (alpha 0: twice the rank), their initial
    weights a function of `seed`, so that every process and every resumed run starts from the same ones;
    or, with `start` (an adapter directory), that adapter's layers and weights, trainable.

    top_layers N > 0: only the top N decoder layers get LoRA layers (all, if it has no more). Nothing below
    the lowest of them needs a gradient, so the backward pass stops there and keeps none of their
    activations: adapting the top third of SmolLM2's 30 layers leaves about two thirds of its linear work."""
    if model.adapter is not None:
        raise FastForwardError(
            f"cannot train an adapter on a model loaded with --adapter {model.adapter}: give the adapter "
            "directory as --model instead (its base is then recorded)"
        )
    if start:
        _continue(model, rank, Path(start))
        return
    from peft import get_peft_model  # imported by LoRA runs only

    config = adapters.lora_config(
        rank, alpha or None, top_modules(model, targets, top_layers) if top_layers else targets
    )
    try:
        with torch.random.fork_rng():
            torch.manual_seed(derive_seed(seed, "lora"))
            with adapters.quiet_peft():
                model.hf = get_peft_model(model.hf, config)
    except ValueError as exc:  # target modules not found
        raise FastForwardError(f"cannot add LoRA layers to {model.name}: {exc}") from exc


def top_modules(model: Model, targets: str, count: int) -> list[str]:
    """The full names of the linear modules that `targets` names ("all-linear": every one, as PEFT counts
    them) inside the top `count` decoder layers (every layer of a model with no more than `count`)."""
    stack = decoder_layers(model)
    count = min(count, len(stack))
    wanted = None if targets == adapters.DEFAULT_TARGETS else {t for t in targets.split(",") if t}
    inside = {id(m) for layer in stack[len(stack) - count :] for m in layer.modules()}
    names = [
        name
        for name, module in model.hf.named_modules()
        if id(module) in inside and isinstance(module, LINEAR) and (wanted is None or name.rsplit(".", 1)[-1] in wanted)
    ]
    if not names:
        raise FastForwardError(f"--lora-targets {targets} names no linear module in the top {count} layers")
    return names


def decoder_layers(model: Model) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the module list of `num_hidden_layers` entries in its decoder."""
    total = model.hf.config.get_text_config().num_hidden_layers
    for module in model.hf.get_decoder().modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == total:
            return module
    raise FastForwardError(f"cannot find the {total} decoder layers of {model.name} for --lora-layers")


def _continue(model: Model, rank: int, start: Path) -> None:
    """The adapter at `start`, trainable, on the model (which must be the base it was trained on)."""
    adapters.check_adapter(start)
    trained_rank = adapters.read_config(start).get("r")
    if trained_rank != rank:
        raise FastForwardError(f"the adapter {start} has rank {trained_rank}, not the run's LoRA rank {rank}")
    from peft import PeftModel

    try:
        with adapters.quiet_peft():
            model.hf = PeftModel.from_pretrained(model.hf, str(start), is_trainable=True)
    except (ValueError, RuntimeError, KeyError) as exc:  # size mismatches, target modules not found
        raise FastForwardError(f"the adapter {start} does not fit {model.name}: {exc}") from exc


@contextlib.contextmanager
def layers(
    model: Model, rank: int, alpha: float, targets: str, seed: int, start: str = "", top_layers: int = 0
) -> Iterator[None]:
    """With rank > 0: the model carries LoRA layers inside the block; a refused or crashed run takes them
    off again, so the caller keeps a plain model. Rank 0: nothing."""
    if not rank:
        yield
        return
    wrap(model, rank, alpha, targets, seed, start, top_layers)
    try:
        yield
    except BaseException:
        model.hf = model.hf.unload()
        raise
