"""Multi-block Teacher Forcing (MultiTF, the MBD-LMs paper): train on states like Block Buffer decoding.

SBD training (`objectives.sbd`) masks blocks one at a time: each noisy block sees the clean tokens
before it. The `mbd` decoder instead refines a running set of consecutive blocks, each seeing the
partly revealed blocks before it in the set, less revealed the further back it sits. MultiTF makes
such states in training:

* **Noise-groups.** Each row's blocks (block size drawn per step, as in SBD) are cut into groups of
  consecutive blocks. A *systematic* layout is one (size g ≤ `max_group`, shift s < g) drawn
  uniformly from all of them, so every block meets every group-relative slot; a *random* layout
  draws each group's size in 1..`max_group` in turn. `layouts="both"` tosses a coin per row.
* **Slot-wise mask ratios** inside a group, increasing along it (the front block is the most
  revealed, as in the buffer): `chain-uniform` sorts one uniform draw per slot (random, often large
  gaps); `d2f` is D2F's gentle slope, a start p0 = U/2 + 0.2 rising linearly by U·0.7 over the
  group (our reading of the references); `uniform` uses one ratio for the whole group;
  `fresh-tail` (ours, from `benchmarks/mbd_statistics.py`) is chain-uniform with the last block of
  half the multi-block groups wholly masked, the state `mbd` meets most: a block just opened behind
  a partly revealed one.
* **Group-aware dual stream** (`visibility.multitf_train`): `[clean ; noisy]` at shared positions;
  a noisy block sees the clean tokens of earlier groups and its group's noisy blocks up to itself;
  clean tokens are causal and never see noisy ones.

Loss: masked-token cross entropy plus `ntp_weight` × NTP on the clean stream, as in SBD. With
`max_group` 1 every block is its own group and this is SBD's layout, with the mask ratio drawn per
block instead of per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastforward.model import visibility
from fastforward.options import AT_LEAST_ONE, option
from fastforward.training.data import Batch
from fastforward.training.objectives.base import row_generators
from fastforward.training.objectives.registry import register
from fastforward.training.objectives.sbd import SBD, Masking, draw_block

LAYOUTS = ("systematic", "random", "both")
SCHEDULES = ("chain-uniform", "d2f", "uniform", "fresh-tail")


def systematic_groups(n_blocks: int, size: int, shift: int) -> list[int]:
    """Group number of each block when groups of `size` blocks start `shift` blocks early."""
    return [(b + shift) // size for b in range(n_blocks)]


def random_groups(n_blocks: int, max_group: int, generator: torch.Generator) -> list[int]:
    """Group number of each block, each group's size drawn uniformly in 1..max_group."""
    sizes = torch.randint(1, max_group + 1, (n_blocks,), generator=generator).tolist()
    groups: list[int] = []
    for number, size in enumerate(sizes):
        groups += [number] * size
        if len(groups) >= n_blocks:
            return groups[:n_blocks]
    return groups


def draw_groups(
    batch_size: int, n_blocks: int, max_group: int, layouts: str, generator: torch.Generator
) -> torch.Tensor:
    """[B, n_blocks] noise-group numbers, one layout per row (see the module docstring)."""
    shapes = [(size, shift) for size in range(1, max_group + 1) for shift in range(size)]
    rows = []
    for coin in torch.rand(batch_size, generator=generator).tolist():
        if layouts == "systematic" or (layouts == "both" and coin < 0.5):
            size, shift = shapes[int(torch.randint(len(shapes), (1,), generator=generator))]
            rows.append(systematic_groups(n_blocks, size, shift))
        else:
            rows.append(random_groups(n_blocks, max_group, generator))
    return torch.tensor(rows, dtype=torch.long)


def group_ratios(groups: torch.Tensor, schedule: str, generator: torch.Generator) -> torch.Tensor:
    """[B, n_blocks] mask ratio of each block, non-decreasing inside each group."""
    batch_size, n_blocks = groups.shape
    if schedule in ("chain-uniform", "fresh-tail"):  # groups are consecutive and in order: one sort does all
        keys = groups * 2 + torch.rand(batch_size, n_blocks, generator=generator)
        ratios = keys.sort(dim=1).values - groups * 2
        if schedule == "fresh-tail":
            last = torch.cat([groups[:, 1:] != groups[:, :-1], torch.ones_like(groups[:, :1], dtype=torch.bool)], 1)
            multi = torch.cat([torch.zeros_like(last[:, :1]), groups[:, 1:] == groups[:, :-1]], 1)  # not first
            coins = torch.rand(batch_size, n_blocks, generator=generator) < 0.5
            ratios = ratios.masked_fill(last & multi & coins, 1.0)
        return ratios
    per_group = torch.rand(2, batch_size, n_blocks, generator=generator)
    if schedule == "uniform":
        return per_group[0].gather(1, groups)
    slots = torch.arange(n_blocks).expand(batch_size, n_blocks)
    first = torch.full_like(groups, n_blocks).scatter_reduce(1, groups, slots, "amin")
    size = torch.zeros_like(groups).scatter_add(1, groups, torch.ones_like(groups))
    offset = slots - first.gather(1, groups)
    slope = (per_group[1] * 0.7).gather(1, groups) / (size.gather(1, groups) - 1).clamp(min=1)
    return (per_group[0] / 2 + 0.2).gather(1, groups).add(slope * offset).clamp(max=1.0)


@register("multitf")
@dataclass
class MultiTF(SBD):
    """SBD's dual stream with noise-groups of consecutive blocks and slot-wise mask ratios."""

    suffix_share: float = field(default=0.0, init=False)  # SBD's masking: MultiTF draws its masks per noise-group
    max_group: int = option(4, "most blocks in a noise-group", AT_LEAST_ONE)
    layouts: str = option("both", "noise-group layouts", choices=LAYOUTS)
    schedule: str = option("chain-uniform", "mask ratios in a group", choices=SCHEDULES)

    def draw(self, batch: Batch, generator: torch.Generator) -> Masking:
        """The block size (once per step); each row's noise-groups, mask ratios and masks (its own stream)."""
        block = draw_block(self.min_block, self.max_block, generator)
        length = batch.tokens.shape[1]
        n_blocks = -(-length // block)
        groups, coins, ratios = [], [], []
        for g in row_generators(batch, generator):
            groups.append(draw_groups(1, n_blocks, self.max_group, self.layouts, g))
            ratios.append(group_ratios(groups[-1], self.schedule, g))
            coins.append(torch.rand(1, length, generator=g))
        grouped = torch.cat(groups)
        per_token = torch.cat(ratios)[:, torch.arange(length) // block]
        masked = (torch.cat(coins) < per_token).to(batch.tokens.device) & batch.loss_mask
        group_size = (n_blocks / (grouped[:, -1] + 1).float()).mean().item()
        return Masking(block, masked, grouped, {"block": float(block), "group_size": group_size})

    def rule(self, length: int, masking: Masking, device: torch.device) -> torch.Tensor:
        return visibility.multitf_train(length, masking.block, masking.groups.to(device))
