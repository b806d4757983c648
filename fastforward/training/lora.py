"""A LoRA run's model: PEFT LoRA layers added before training, taken off again if the run fails.

The trainer saves the adapter itself (`run_dir.save_final`); loading and merging are in
`fastforward.model.adapters`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from fastforward.errors import FastForwardError
from fastforward.model import Model, adapters
from fastforward.training.data import derive_seed


def wrap(model: Model, rank: int, alpha: float, targets: str, seed: int, start: str = "") -> None:
    """Freeze the model and give it LoRA layers of `rank` (alpha 0: twice the rank), their initial
    weights a function of `seed`, so that every process and every resumed run starts from the same ones;
    or, with `start` (an adapter directory), that adapter's layers and weights, trainable."""
    if model.adapter is not None:
        raise FastForwardError(
            f"cannot train an adapter on a model loaded with --adapter {model.adapter}: give the adapter "
            "directory as --model instead (its base is then recorded)"
        )
    if start:
        _continue(model, rank, Path(start))
        return
    from peft import get_peft_model  # imported by LoRA runs only

    config = adapters.lora_config(rank, alpha or None, targets)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(derive_seed(seed, "lora"))
            with adapters.quiet_peft():
                model.hf = get_peft_model(model.hf, config)
    except ValueError as exc:  # target modules not found
        raise FastForwardError(f"cannot add LoRA layers to {model.name}: {exc}") from exc


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
def layers(model: Model, rank: int, alpha: float, targets: str, seed: int, start: str = "") -> Iterator[None]:
    """With rank > 0: the model carries LoRA layers inside the block; a refused or crashed run takes them
    off again, so the caller keeps a plain model. Rank 0: nothing."""
    if not rank:
        yield
        return
    wrap(model, rank, alpha, targets, seed, start)
    try:
        yield
    except BaseException:
        model.hf = model.hf.unload()
        raise
