"""What every training objective shares: the interface the trainer calls and the label-masked loss.

An objective turns a batch into a layout, runs it, and returns a scalar loss plus float metrics.
Labels use -100 (IGNORE) where a row has no target, like Hugging Face; only the slots that have a
label are read (`Model.outputs_at`) and projected to the vocabulary a chunk at a time with their loss
(`fastforward.model.head`), so full-sequence logits are never materialised.

So that a training step gives the same update however its rows are split across processes and
micro-batches, an objective's loss is a weighted sum of terms, each a sum over its tokens divided
by a denominator the trainer may set (`norms`: the term's token count over the whole step, which
`counts` tells it beforehand), and every random draw is a function of the step and of the row
(`row_generators`), never of the process or micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, ClassVar

import torch

from fastforward.model import Layout, Model, head
from fastforward.model.head import IGNORE, HeadRows
from fastforward.model.visibility import causal, over_cache
from fastforward.options import check_options
from fastforward.training.data import Batch, derive_seed

# The denominator of each loss term, by name (see `Objective.loss`); None: each term's own token count.
Norms = Mapping[str, float] | None


class Objective:
    """Base of the training objectives; subclasses are dataclasses whose fields are their options."""

    name: ClassVar[str]  # given by `objectives.registry.register`
    # Copies of each data row the training layout reads (SBD and SetDLM: the clean row and its masked copy):
    # the trainer counts the tokens the model reads, so budgets in tokens mean equal compute across methods.
    copies: ClassVar[int] = 1

    def __post_init__(self) -> None:
        """Refuse option values outside their bounds, however the objective is made (`fastforward train`,
        a recipe, Python); an objective with rules between its options checks them after these."""
        check_options(self)

    def setup(self, model: Model) -> None:
        """Prepare the model before the optimizer sees its parameters (e.g. add a mask token)."""

    def loss(
        self, model: Model, batch: Any, generator: torch.Generator, norms: Norms = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss of one batch and float metrics.

        Each term is the sum over its tokens divided by `norms[term]`, by default the batch's own count
        of them (a mean). Randomness: draws shared by the whole batch (SBD's block size) come from
        `generator` (CPU), each row's own draws from its stream in `row_generators(batch, generator)`.
        """
        raise NotImplementedError

    def counts(self, model: Model, batch: Any, generator: torch.Generator) -> dict[str, int]:
        """How many tokens each term of `loss(model, batch, generator)` sums over, without running the model:
        the trainer adds them up over a step before its first backward pass."""
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
    return Layout(batch.tokens, positions(batch), over_cache(rule, 0, batch.valid))


def next_token_labels(batch: Batch) -> torch.Tensor:
    """Label of position i is token i+1 where that token is a target; the last position has none."""
    following = batch.tokens[:, 1:].masked_fill(~batch.loss_mask[:, 1:], IGNORE)
    return torch.cat([following, following.new_full((following.shape[0], 1), IGNORE)], dim=1)


def row_generators(batch: Any, generator: torch.Generator) -> list[torch.Generator]:
    """One random stream per row of `batch` (a `Batch` or `TrajectoryBatch`), seeded by `generator`'s
    seed and the row's place in the data stream (`batch.ids`): a row draws the same whichever process
    or micro-batch of the step it lands in."""
    seed = generator.initial_seed()
    return [torch.Generator().manual_seed(derive_seed(seed, "row", i)) for i in batch.ids]


def per_row(
    batch: Batch, generator: torch.Generator, draw: Callable[[Batch, torch.Generator], torch.Tensor]
) -> torch.Tensor:
    """`draw(row, its generator)` ([1, ...]) for every row of `batch`, concatenated: [B, ...]."""
    return torch.cat([draw(batch.row(r), g) for r, g in enumerate(row_generators(batch, generator))])


def term_norm(norms: Norms, term: str) -> float | None:
    """The denominator `norms` gives a loss term, or None for the term's own token count."""
    return None if norms is None else norms[term]


def mean_over(total: torch.Tensor, count: int, norm: float | None) -> torch.Tensor:
    """`total` (a sum over `count` tokens) over `norm`, or over the count itself (at least 1) when None."""
    return total / (max(count, 1) if norm is None else norm)


def labelled(labels: torch.Tensor) -> int:
    """How many positions of `labels` have a label."""
    return int((labels != IGNORE).sum())


def labelled_slots(labels: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, slots) of the positions of `labels` [B, T] that have a label, row by row (the order of
    `labels[labels != IGNORE]`), the slots shifted by `offset` (labels of a layout's later part)."""
    rows, slots = (labels != IGNORE).nonzero().unbind(1)
    return rows, slots + offset


def label_loss(rows: HeadRows, labels: torch.Tensor, norm: float | None = None) -> tuple[torch.Tensor, int]:
    """Cross entropy summed over `rows` (what the model outputs at the `labelled_slots` of `labels`, in their
    order) against those labels, over `norm` (default: their count, a mean), and their count.

    With no labelled slot the loss is an exact zero that still belongs to the graph.
    """
    targets = labels[labels != IGNORE]
    return mean_over(head.cross_entropy(rows, targets), len(targets), norm), len(targets)


def next_token_loss(model: Model, batch: Batch, norm: float | None = None) -> tuple[torch.Tensor, int]:
    """`label_loss` of a plain causal pass over `batch` against `next_token_labels` (the NTP loss)."""
    labels = next_token_labels(batch)
    (rows,) = model.outputs_at(causal_layout(batch), labelled_slots(labels))
    return label_loss(rows, labels, norm)
