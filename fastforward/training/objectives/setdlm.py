"""Set Diffusion training (SW-SetDLM): position-offset reveal orders, singleton sets, one forward.

**Order.** Each row draws a reveal order from the position-offset ("staggered") schedule. Over L
positions with spacing 1 / (L + s_max − 1), position ℓ's window opens at loc_ℓ = ℓ · spacing and
lasts b = s_max · spacing, so it overlaps about s_max neighbours (s_max = `max_set`, twice the
desired set size). Inside its window a position is revealed with probability 1 − (1 − x)^k, x the
share of the window elapsed, k = area / (b − area) with area = `set_size` / (2L); its first-hitting
time is loc_ℓ + b · (1 − e^(−E/k)), E ~ Exp(1). Sorting the times gives the order. Tokens without
a loss (the prompt) come first, in position order (each at its window's opening minus b, so in a
packed row a later example's prompt comes just before that example's targets); padding comes last.
Small `max_set`: nearly left to right; large: close to any-order masked diffusion.
Each row draws from its own stream (`row_generators`).

**Layout.** `[clean x ; masked copy]` at true positions; the copy has every target replaced by
the mask token. Under `visibility.reveal_order` a clean token sees the clean tokens revealed
before it and itself; a mask at ℓ sees the clean tokens revealed before ℓ's token, and itself;
masks never see masks. Loss: cross entropy of the true token at every mask (targets only), plus
`ntp_weight` × NTP on a separate causal pass of the clean tokens (0 skips that pass). The default,
1, is measured (`benchmarks/setdlm.py --ntp-ablation`, docs/results.md "Set Diffusion"): on the demo's
task the NTP term keeps AR mode and lifts sliding-window decoding too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model, visibility
from fastforward.options import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, option
from fastforward.training.data import Batch
from fastforward.training.objectives.base import (
    IGNORE,
    Norms,
    Objective,
    label_loss,
    labelled,
    labelled_slots,
    next_token_labels,
    next_token_loss,
    per_row,
    positions,
    term_norm,
)
from fastforward.training.objectives.registry import register


def hitting_times(length: int, set_size: float, max_set: float, batch: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] first-hitting times of the position-offset schedule, in [0, 1]."""
    spacing = 1.0 / (length + max_set - 1)
    width = max_set * spacing
    area = set_size / (2 * length)
    if not 0 < area < width:
        raise FastForwardError(
            f"set_size {set_size} does not fit max_set {max_set} at length {length}: need set_size / (2L) < "
            f"max_set / (L + max_set - 1); use a smaller set size or a larger max set"
        )
    k = area / (width - area)
    draws = -torch.rand(batch, length, generator=generator).clamp_min(1e-12).log()  # Exp(1)
    starts = torch.arange(length) * spacing
    return starts + width * (1 - torch.exp(-draws / k))


def reveal_ranks(
    targets: torch.Tensor,
    valid: torch.Tensor,
    set_size: float,
    max_set: float,
    generator: torch.Generator,
    context_first: bool = False,
) -> torch.Tensor:
    """[B, L] each token's place in its row's reveal order (padding last). Tokens that are not
    targets come just before the targets near them, or, with `context_first`, before every target
    (an infilling row: prefix and suffix are known, the middle is revealed in the schedule's order)."""
    rows, length = targets.shape
    device = valid.device
    times = hitting_times(length, set_size, max_set, rows, generator)
    spacing = 1.0 / (length + max_set - 1)
    starts = torch.arange(length) * spacing
    targets, valid = targets.cpu(), valid.cpu()
    keys = torch.where(targets, times, starts - (2.0 if context_first else max_set * spacing))
    keys = torch.where(valid, keys, 2 + starts)
    return keys.argsort(dim=1).argsort(dim=1).to(device)


def middle_span(valid: torch.Tensor, max_span: int, generator: torch.Generator) -> torch.Tensor:
    """[1, L] a run of 1..`max_span` consecutive valid tokens at a uniform place: an infilling row's
    middle (prompt tokens included, so the model learns to fill any text between known text)."""
    count = int(valid.sum())
    span = min(int(torch.randint(1, max_span + 1, (1,), generator=generator)), count)
    start = int(torch.randint(0, count - span + 1, (1,), generator=generator))
    place = torch.arange(valid.shape[-1], device=valid.device)
    return valid & (place >= start) & (place < start + span)


def setdlm_layout(
    batch: Batch, targets: torch.Tensor, ranks: torch.Tensor, mask_id: int
) -> tuple[Layout, torch.Tensor]:
    """The two-stream layout and its labels [B, 2L] (only the masks are labelled: copy ℓ → x_ℓ)."""
    copy = batch.tokens.masked_fill(targets, mask_id)
    rule = visibility.reveal_order(ranks, ranks)
    layout = Layout(
        tokens=torch.cat([batch.tokens, copy], dim=1),
        positions=positions(batch).repeat(1, 2),
        visibility=visibility.over_cache(rule, 0, batch.valid.repeat(1, 2)),
    )
    labels = torch.cat([torch.full_like(batch.tokens, IGNORE), batch.tokens.masked_fill(~targets, IGNORE)], 1)
    return layout, labels


@register("setdlm")
@dataclass
class SetDLM(Objective):
    """Every target predicted once, as a singleton set, from the tokens revealed before it."""

    copies = 2  # the clean row and its masked copy

    set_size: float = option(4.0, "desired tokens per reveal set", POSITIVE)
    max_set: float = option(8.0, "reveal window width s_max", AT_LEAST_ONE)
    ntp_weight: float = option(1.0, "weight of the NTP term", NON_NEGATIVE)
    # infilling rows: `middle_span`, context first (ours, not the paper's)
    infill_share: float = option(0.0, "share of rows trained to fill a middle span between known text", FRACTION)
    max_span: int = option(8, "longest middle of an infilling row", AT_LEAST_ONE)

    def setup(self, model: Model) -> None:
        model.add_mask_token()

    def draw(self, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's targets and reveal ranks ([B, L] each), from the row's own stream."""
        drawn = per_row(batch, generator, self._draw_row)
        return drawn[:, 0].bool(), drawn[:, 1]

    def _draw_row(self, row: Batch, generator: torch.Generator) -> torch.Tensor:
        """[1, 2, L]: the row's targets and ranks; an `infill_share` of rows are infilling rows."""
        targets, infill = row.loss_mask, False
        if self.infill_share and float(torch.rand(1, generator=generator)) < self.infill_share:
            targets, infill = middle_span(row.valid, self.max_span, generator), True
        ranks = reveal_ranks(targets, row.valid, self.set_size, self.max_set, generator, context_first=infill)
        return torch.stack([targets.long(), ranks], dim=1)

    def loss(
        self, model: Model, batch: Batch, generator: torch.Generator, norms: Norms = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        targets, ranks = self.draw(batch, generator)
        layout, labels = setdlm_layout(batch, targets, ranks, model.require_mask_token(self.name))
        (rows,) = model.outputs_at(layout, labelled_slots(labels))  # only the copy's masks are labelled
        mask, count = label_loss(rows, labels, term_norm(norms, "mask"))
        metrics = {"mask_loss": mask.item(), "masked": float(count)}
        loss = mask
        if self.ntp_weight > 0:
            ntp, _ = next_token_loss(model, batch, term_norm(norms, "ntp"))
            loss = mask + self.ntp_weight * ntp
            metrics["ntp_loss"] = ntp.item()
        return loss, {"loss": loss.item(), **metrics}

    def counts(self, model: Model, batch: Batch, generator: torch.Generator) -> dict[str, int]:
        """Every target is masked once, whatever the order (infilling rows: their middles)."""
        targets = self.draw(batch, generator)[0] if self.infill_share else batch.loss_mask
        counts = {"mask": int(targets.sum())}
        if self.ntp_weight > 0:
            counts["ntp"] = labelled(next_token_labels(batch))
        return counts
