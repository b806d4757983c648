"""A collection shared by the processes of a launch (`torchrun --nproc_per_node N -m fastforward
trajectories ...`): each collects its share of the prompts into its own part file, and process 0
folds the parts into the output (`writer.merge_parts`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from fastforward.model import Model
from fastforward.training.trajectories.sources import Collection, PromptSource, collect_from
from fastforward.training.trajectories.writer import CollectSummary, merge_parts


def collect_shards(
    model: Model, source: PromptSource, collection: Collection, path: str | Path, block_size: int
) -> CollectSummary:
    """`collect_from` in every process of a launch (torchrun), each on its share of the prompts; process 0
    folds the shares into `path`. The summary counts the work of every process."""
    dist.init_process_group("gloo")
    try:
        rank, processes = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            merge_parts(path)  # what a killed launch left, perhaps of another number of processes
        dist.barrier()
        mine = collect_from(model, source, collection, path, block_size, shard=(rank, processes))
        dist.barrier()
        if rank == 0:
            merge_parts(path)
        counts = ("written", "skipped", "forwards", "tokens", "correct")
        totals = torch.tensor([getattr(mine, name) for name in counts], dtype=torch.float64)
        dist.all_reduce(totals)
        return CollectSummary(**{name: int(v) for name, v in zip(counts, totals.tolist(), strict=True)}, path=str(path))
    finally:
        dist.destroy_process_group()
