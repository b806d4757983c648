"""Next-token prediction: the ordinary causal LM loss on the loss-masked tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastforward.model import Model
from fastforward.training.data import Batch
from fastforward.training.objectives.base import Objective, causal_layout, label_loss, next_token_labels


@dataclass
class NTP(Objective):
    """Cross entropy of each target token given the tokens before it, averaged over the targets."""

    name = "ntp"

    def loss(self, model: Model, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        hidden = model.hidden_states(causal_layout(batch))
        loss, count = label_loss(model, hidden, next_token_labels(batch))
        return loss, {"loss": loss.item(), "ntp_loss": loss.item(), "ntp_tokens": float(count)}
