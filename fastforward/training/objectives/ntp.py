"""Next-token prediction: the ordinary causal LM loss on the loss-masked tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastforward.model import Model
from fastforward.training.data import Batch
from fastforward.training.objectives.base import (
    Norms,
    Objective,
    labelled,
    next_token_labels,
    next_token_loss,
    term_norm,
)
from fastforward.training.objectives.registry import register


@register("ntp")
@dataclass
class NTP(Objective):
    """Cross entropy of each target token given the tokens before it, averaged over the targets."""

    def loss(
        self, model: Model, batch: Batch, generator: torch.Generator, norms: Norms = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss, count = next_token_loss(model, batch, term_norm(norms, "ntp"))
        return loss, {"loss": loss.item(), "ntp_loss": loss.item(), "ntp_tokens": float(count)}

    def counts(self, model: Model, batch: Batch, generator: torch.Generator) -> dict[str, int]:
        return {"ntp": labelled(next_token_labels(batch))}
