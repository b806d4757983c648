"""Set Block Decoding training (SBD paper eq. 13-14, Algorithm 1, Figures 7-9).

Each row x of length L is doubled into `[x ; x̂]`. The copy x̂ replaces every target token by the
mask token with probability η ~ U(0, 1), drawn per row (prompt tokens stay clean, so a masked
token is always one the model should learn to produce). Both halves share positions 0..L-1. Under
`visibility.sbd_train(L, k)` the clean half is an ordinary causal LM, and a copy position in block
b sees the clean tokens of blocks before b and the whole of its own block in the copy. The block
size k is drawn uniformly from [min_block, max_block] once per step (from the step's generator, so
every process and micro-batch of a step uses the same k); η and the masks are drawn per row, from the
row's own stream.

Loss = mask term + ntp_weight · NTP term, each term the mean cross entropy over its own tokens
(targets of the clean half; masked positions of the copy, whose label is the token *at* that
position). Averaging each term separately keeps their scales comparable whatever η and the prompt
share are. ntp_weight = 0 is the paper's "SBD without NTP loss" ablation: the NTP term is still
computed and logged, without gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model, visibility
from fastforward.options import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, option
from fastforward.training.data import Batch
from fastforward.training.objectives.base import (
    IGNORE,
    Norms,
    Objective,
    label_loss,
    labelled,
    labelled_slots,
    next_token_labels,
    per_row,
    positions,
    term_norm,
)
from fastforward.training.objectives.registry import register


def draw_block(min_block: int, max_block: int, generator: torch.Generator) -> int:
    return int(torch.randint(min_block, max_block + 1, (1,), generator=generator))


def draw_masked(loss_mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Eq. 13: each target token is masked with probability η, η ~ U(0, 1) per row."""
    eta = torch.rand(loss_mask.shape[0], 1, generator=generator)
    coins = torch.rand(loss_mask.shape, generator=generator)
    return (coins < eta).to(loss_mask.device) & loss_mask


def draw_block_suffixes(loss_mask: torch.Tensor, block: int, generator: torch.Generator) -> torch.Tensor:
    """Each block of `block` positions masked from a uniform cut in [0, block) to its end: the left
    part is revealed and the right part masked, the state a decoder that reveals the leftmost
    masked position walks through (rare under eq. 13, whose masks are independent per token)."""
    length = loss_mask.shape[-1]
    offsets = torch.arange(length) % block
    cuts = torch.randint(0, block, (loss_mask.shape[0], -(-length // block)), generator=generator)
    return (offsets >= cuts.repeat_interleave(block, dim=1)[:, :length]).to(loss_mask.device) & loss_mask


def sbd_layout(batch: Batch, masked: torch.Tensor, block: int, mask_id: int) -> tuple[Layout, torch.Tensor]:
    """The doubled layout of Fig. 8 and its labels [B, 2L]: clean i → x_{i+1}, masked copy i → x_i."""
    rule = visibility.sbd_train(batch.tokens.shape[1], block, batch.tokens.device)
    return dual_stream_layout(batch, masked, rule, mask_id)


def dual_stream_layout(
    batch: Batch, masked: torch.Tensor, rule: torch.Tensor, mask_id: int
) -> tuple[Layout, torch.Tensor]:
    """`[clean x ; copy with `masked` replaced by the mask token]` at shared positions, under `rule`
    ([2L, 2L], or [B, 2L, 2L] per row), and its labels [B, 2L]: clean i → x_{i+1}, copy i → x_i."""
    copy = batch.tokens.masked_fill(masked, mask_id)
    layout = Layout(
        tokens=torch.cat([batch.tokens, copy], dim=1),
        positions=positions(batch).repeat(1, 2),
        visibility=visibility.over_cache(rule, 0, batch.valid.repeat(1, 2)),
    )
    labels = torch.cat([next_token_labels(batch), batch.tokens.masked_fill(~masked, IGNORE)], dim=1)
    return layout, labels


def dual_stream_loss(
    model: Model,
    batch: Batch,
    masked: torch.Tensor,
    rule: torch.Tensor,
    ntp_weight: float,
    mask_id: int,
    norms: Norms = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """mask term + ntp_weight · NTP term over `dual_stream_layout` (the NTP term is still computed
    and logged at weight 0, without gradient); `mask_rate` is the share of target tokens masked.
    The terms' denominators are `norms["mask"]` and `norms["ntp"]` (see `Objective.loss`)."""
    layout, labels = dual_stream_layout(batch, masked, rule, mask_id)
    length = batch.tokens.shape[1]
    clean, copy = labels[:, :length], labels[:, length:]
    clean_rows, copy_rows = model.outputs_at(layout, labelled_slots(clean), labelled_slots(copy, length))
    with torch.no_grad() if ntp_weight == 0 else contextlib.nullcontext():
        ntp, _ = label_loss(clean_rows, clean, term_norm(norms, "ntp"))
    mask, count = label_loss(copy_rows, copy, term_norm(norms, "mask"))
    loss = mask + ntp_weight * ntp
    rate = count / max(int(batch.loss_mask.sum()), 1)
    return loss, {"loss": loss.item(), "ntp_loss": ntp.item(), "mask_loss": mask.item(), "mask_rate": rate}


@dataclass
class Masking:
    """One batch's draws for the dual stream: the block size, the masked targets, the noise-groups of
    its blocks (MultiTF; None: every block alone) and what to log about them."""

    block: int
    masked: torch.Tensor
    groups: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)


@register("sbd")
@dataclass
class SBD(Objective):
    """NTP on the clean half plus masked-token prediction on the block-masked copy."""

    copies = 2  # the clean row and its masked copy

    min_block: int = option(2, "smallest block size drawn", AT_LEAST_ONE)
    max_block: int = option(16, "largest block size drawn", AT_LEAST_ONE)
    ntp_weight: float = option(1.0, "weight of the NTP term", NON_NEGATIVE)
    # rows masked by `draw_block_suffixes` instead of eq. 13 (ours, not the paper's)
    suffix_share: float = option(0.0, "share of rows whose blocks are masked from a random cut to their end", FRACTION)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_block > self.max_block:
            raise FastForwardError(
                f"block sizes must satisfy min_block <= max_block, got {self.min_block} and {self.max_block}"
            )

    def setup(self, model: Model) -> None:
        model.add_mask_token()

    def draw(self, batch: Batch, generator: torch.Generator) -> Masking:
        """The block size (once per step) and each row's masks (from the row's stream)."""
        block = draw_block(self.min_block, self.max_block, generator)
        masked = per_row(batch, generator, lambda row, g: self._draw_row(row.loss_mask, block, g))
        return Masking(block, masked, stats={"block": float(block)})

    def _draw_row(self, loss_mask: torch.Tensor, block: int, generator: torch.Generator) -> torch.Tensor:
        """One row's masks: block suffixes for a `suffix_share` of rows, eq. 13 for the rest."""
        if self.suffix_share and float(torch.rand(1, generator=generator)) < self.suffix_share:
            return draw_block_suffixes(loss_mask, block, generator)
        return draw_masked(loss_mask, generator)

    def rule(self, length: int, masking: Masking, device: torch.device) -> torch.Tensor:
        """The visibility rule of the dual stream under `masking`."""
        return visibility.sbd_train(length, masking.block, device)

    def loss(
        self, model: Model, batch: Batch, generator: torch.Generator, norms: Norms = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        masking = self.draw(batch, generator)
        rule = self.rule(batch.tokens.shape[1], masking, batch.tokens.device)
        mask_id = model.require_mask_token(self.name)
        loss, metrics = dual_stream_loss(model, batch, masking.masked, rule, self.ntp_weight, mask_id, norms)
        return loss, {**metrics, **masking.stats}

    def counts(self, model: Model, batch: Batch, generator: torch.Generator) -> dict[str, int]:
        return {"ntp": labelled(next_token_labels(batch)), "mask": int(self.draw(batch, generator).masked.sum())}
