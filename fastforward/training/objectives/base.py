"""What every training objective shares: the interface the trainer calls and the label-masked loss.

An objective turns a batch into a layout, runs it, and returns a scalar loss plus float metrics.
Labels use -100 (IGNORE) where a row has no target, like Hugging Face; only the rows that have a
label are projected to the vocabulary, so full-sequence logits are never materialised.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import ClassVar

import torch
import torch.nn.functional as F

from fastforward.model import Layout, Model
from fastforward.model.visibility import against_cache, causal
from fastforward.training.data import Batch

IGNORE = -100


class Objective:
    """Base of the training objectives; subclasses are dataclasses whose fields are their options."""

    name: ClassVar[str]

    def setup(self, model: Model) -> None:
        """Prepare the model before the optimizer sees its parameters (e.g. add a mask token)."""

    def loss(self, model: Model, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss of one batch and float metrics. All randomness must come from `generator` (CPU)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Name and options: what a resumed run must share with the run it continues."""
        return {"name": self.name, **asdict(self)}


def positions(batch: Batch) -> torch.Tensor:
    """RoPE positions 0..L-1 of every row."""
    batch_size, length = batch.tokens.shape
    return torch.arange(length, device=batch.tokens.device).expand(batch_size, length)


def causal_layout(batch: Batch) -> Layout:
    """Plain causal pass over packed rows; padding keys are hidden."""
    rule = causal(batch.tokens.shape[1], batch.tokens.device)
    return Layout(batch.tokens, positions(batch), against_cache(rule, batch.valid))


def next_token_labels(batch: Batch) -> torch.Tensor:
    """Label of position i is token i+1 where that token is a target; the last position has none."""
    following = batch.tokens[:, 1:].masked_fill(~batch.loss_mask[:, 1:], IGNORE)
    return torch.cat([following, following.new_full((following.shape[0], 1), IGNORE)], dim=1)


def label_loss(model: Model, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean cross entropy (fp32) over the rows of `hidden` that have a label, and their count.

    With no labelled row the loss is an exact zero that still belongs to the graph.
    """
    chosen = labels != IGNORE
    logits = model.logits(hidden[chosen]).float()
    count = int(chosen.sum())
    return F.cross_entropy(logits, labels[chosen], reduction="sum") / max(count, 1), count
