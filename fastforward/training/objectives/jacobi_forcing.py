"""Jacobi Forcing (Jacobi Forcing paper §3.1, eq. 7-9, Fig. 2 and 6, Appendix C).

Training data are the model's own Jacobi trajectories (`fastforward.training.trajectories`). For block i of
an example the noise schedule gives a ratio tᵢ; the block's noisy copy is the trajectory point
whose unconverged fraction (tokens differing from the fixed point, over n) is nearest tᵢ, the
earliest such point on a tie. One row packs

    [prompt, noisy₁, clean₁, noisy₂, clean₂, …]      clean_i = the fixed point of block i

with noisy_i and clean_i at the same positions. Under the noise-conditioned causal rule (Fig. 2b,
`noisy_context="noisy"`) noisy_i sees the prompt, the noisy blocks before it and itself causally;
clean_i sees the prompt, the clean blocks before it and itself causally, so the clean stream is an
ordinary causal LM over `[prompt, response]`. The clean-context rule (Fig. 2a,
`noisy_context="clean"`) lets noisy_i see the clean blocks before it instead of the noisy ones.
Rows of unequal length share bins (`pack`, `bin_capacity`): a short row sits beside others, at its
own positions and seeing only itself, rather than padded to the longest, where that costs less.

Loss (eq. 9) = L_pc + ar_weight · L_AR, one forward:
- L_pc (eq. 8): KL(p_θ⁻(· | clean slot) ‖ p_θ(· | noisy slot)) for every slot of every noisy block
  that has a next response token,
  the teacher being the same forward's distribution at the matching clean slot, detached
  (stop-gradient); averaged over the noisy tokens of the batch.
- L_AR: cross entropy of the next response token at the last prompt slot and every clean slot
  (the response is the fixed points concatenated: the model's own greedy output); averaged.

Blocks are cut after the response's first stop token (collection decodes whole blocks, so the
fixed points run on past the answer; those tokens are not trained on).

Schedules (eq. 7, with blocks numbered from 0 within a row): W = {0, 1/w, …, (w-1)/w};
"progressive" tᵢ = W[i mod w]; "reverse" tᵢ = W[w-1 - (i mod w)]; "random" tᵢ drawn uniformly from W
(each example from its own stream, `row_generators`).

State sources (`states`), where a block's noisy copy at ratio t comes from:
- "rollout": the recorded Jacobi iterate nearest t (the paper's data, here the states the `jacobi`
  decoder passes through, `trajectories.rollout`; collecting it costs a Jacobi decode of every prompt);
- "random-tail": the clean block with its rightmost round(t·n) tokens replaced by tokens drawn
  uniformly from the `TAIL_POOL` tokens before them (the Jacobi Forcing repository's
  progressive-masking preparation, no rollout): trains on ground-truth responses as they are
  (`trajectories.dataset.from_examples`), or on a trajectory file's fixed points;
- "rollout-aug": the recorded iterate nearest t with a random half of its wrong tokens set to the
  fixed point's (CLLM's `--use_aug`).
A row's draws come from its own stream, so a resumed or sharded run draws the same states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model, head, visibility
from fastforward.options import AT_LEAST_ONE, NON_NEGATIVE, option
from fastforward.training.objectives.base import (
    Norms,
    Objective,
    labelled,
    mean_over,
    row_generators,
    term_norm,
)
from fastforward.training.objectives.registry import register
from fastforward.training.trajectories.dataset import TrajectoryBatch
from fastforward.training.trajectories.records import REFERENCE, Block, Trajectory

SCHEDULES = ("progressive", "random", "reverse")
STATE_SOURCES = ("rollout", "random-tail", "rollout-aug")
TAIL_POOL = 128  # random-tail draws its tokens from this many tokens before the replaced ones


# ---- schedule and trajectory points -------------------------------------------------------------
def noise_ratios(
    blocks: int, schedule: str = "progressive", window: int = 16, generator: torch.Generator | None = None
) -> list[float]:
    """The noise ratio tᵢ of each of `blocks` blocks (eq. 7 and the two ablation schedules)."""
    if window < 1:
        raise FastForwardError(f"the noise window must be at least 1, got {window}")
    if schedule == "progressive":
        steps = [i % window for i in range(blocks)]
    elif schedule == "reverse":
        steps = [window - 1 - i % window for i in range(blocks)]
    elif schedule == "random":
        steps = torch.randint(0, window, (blocks,), generator=generator).tolist()
    else:
        raise FastForwardError(f"unknown noise schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return [s / window for s in steps]


def choose_point(block: Block, ratio: float) -> list[int]:
    """The trajectory point (fixed point included) whose unconverged fraction is nearest `ratio`."""
    points = block.trajectory
    best = min(range(len(points)), key=lambda j: (abs(block.unconverged(points[j]) - ratio), j))
    return points[best]


def random_tail(before: Sequence[int], block: Sequence[int], ratio: float, generator: torch.Generator) -> list[int]:
    """`block` with its rightmost round(ratio·n) tokens replaced by tokens drawn uniformly from the
    `TAIL_POOL` tokens that precede them (`before`, the row's tokens before the block, then the block's kept head)."""
    n = len(block)
    k = min(n, round(ratio * n))
    if k == 0:
        return list(block)
    pool = [*before, *block[: n - k]][-TAIL_POOL:] or list(block)  # nothing before: the block's own tokens
    picks = torch.randint(len(pool), (k,), generator=generator).tolist()
    return [*block[: n - k], *(pool[p] for p in picks)]


def half_corrected(state: Sequence[int], fixed: Sequence[int], generator: torch.Generator) -> list[int]:
    """`state` with a random half (rounded down) of the positions where it differs from `fixed` set to
    `fixed`'s token (CLLM's augmentation)."""
    wrong = [i for i, (a, b) in enumerate(zip(state, fixed, strict=True)) if a != b]
    chosen = torch.randperm(len(wrong), generator=generator)[: len(wrong) // 2].tolist()
    out = list(state)
    for j in chosen:
        out[wrong[j]] = fixed[wrong[j]]
    return out


def cut_after_stop(
    noisy: list[list[int]], clean: list[list[int]], stop_ids: Sequence[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """The blocks up to the first stop token of the clean response (kept), the rest dropped."""
    stops = set(stop_ids)
    for i, block in enumerate(clean):
        for k, token in enumerate(block):
            if token in stops:
                return [*noisy[:i], noisy[i][: k + 1]], [*clean[:i], block[: k + 1]]
    return noisy, clean


# ---- packing ----------------------------------------------------------------------------------
@dataclass
class Packed:
    """A packed batch: the layout, the slots each loss reads, and the AR labels.

    `noisy` (bins, slots): the student's slots, those with a next response token. `read` (bins,
    slots): the clean stream's slots that are projected — each row's last prompt slot, then every
    clean slot but the response's last (it predicts nothing). `teacher[j]` indexes the `read` slot
    matching noisy slot j (same block, same offset). `labels[i]`: the next response token after
    `read` slot i. `places[r]`: the (bin, offset) where row r starts.
    """

    layout: Layout
    noisy: tuple[torch.Tensor, torch.Tensor]
    read: tuple[torch.Tensor, torch.Tensor]
    teacher: torch.Tensor
    labels: torch.Tensor
    noise: float  # mean unconverged fraction of the noisy blocks
    places: list[tuple[int, int]]


def row_length(row: tuple[list[int], list[list[int]], list[list[int]]]) -> int:
    """Slots of `[prompt, noisy₁, clean₁, …]`."""
    prompt, _, clean = row
    return len(prompt) + 2 * sum(map(len, clean))


def places(lengths: Sequence[int], capacity: int | None = None) -> list[tuple[int, int]]:
    """(bin, offset) of each row: first fit, longest rows first, into bins of `capacity` slots (at least
    the longest row); None: every row in a bin of its own."""
    if capacity is None:
        return [(r, 0) for r in range(len(lengths))]
    if capacity < max(lengths):
        raise FastForwardError(f"a bin of {capacity} slots cannot hold a row of {max(lengths)}")
    used: list[int] = []
    out: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for r in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        b = next((b for b, filled in enumerate(used) if filled + lengths[r] <= capacity), len(used))
        if b == len(used):
            used.append(0)
        out[r] = (b, used[b])
        used[b] += lengths[r]
    return out


def bin_capacity(lengths: Sequence[int], crossover: float, most: int = 4) -> int:
    """The bin size, k · the longest row for k in 1, 9/8, 10/8 … `most`, of least estimated cost: bins × width ×
    (1 + width / `crossover`), width being the fullest bin (linear layers cost per slot, padding included; a
    dense attention mask makes every slot pay for every slot of its bin); the smallest on a tie. Rows of
    equal length: k = 1."""
    longest = max(lengths)
    sizes = sorted({longest * eighths // 8 for eighths in range(8, 8 * most + 1)})

    def cost(capacity: int) -> float:
        bins: dict[int, int] = {}
        for (b, _), n in zip(places(lengths, capacity), lengths, strict=True):
            bins[b] = bins.get(b, 0) + n
        width = max(bins.values())
        return len(bins) * width * (1 + width / crossover)

    return min(sizes, key=cost)


def attention_crossover(model: Model) -> float:
    """The context length at which a token's attention costs about what its linear layers cost, forward and
    backward: about 8 × heads × head size multiply-adds per key (scores and weighted values, their gradients,
    the scores recomputed) against twice the layer's weights (SmolLM2-135M: about 1,500 keys)."""
    config = model.hf.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    ends = (model.hf.get_input_embeddings(), model.hf.get_output_embeddings())
    embeddings = {id(getattr(end, "weight", None)) for end in ends}
    weights = sum(p.numel() for p in model.hf.parameters() if p.ndim >= 2 and id(p) not in embeddings)
    return 2 * weights / config.num_hidden_layers / (8 * heads * head_dim)


def pack(
    rows: Sequence[tuple[list[int], list[list[int]], list[list[int]]]],
    pad_id: int,
    noisy_context: str = "noisy",
    device: torch.device | str = "cpu",
    capacity: int | None = None,
) -> Packed:
    """Pack (prompt, noisy blocks, clean blocks) rows into one right-padded layout [bins, T]: each row in a
    bin of its own, or, with `capacity`, several rows side by side in bins of that many slots (`places`),
    each row at its own positions from 0 and seeing only itself, so that a row's logits are those it has
    alone (up to float rounding) and padding is cut. The loss slots are listed row by row either way."""
    lengths = [row_length(row) for row in rows]
    where = places(lengths, capacity)
    bins = 1 + max(b for b, _ in where)
    width = max(offset + n for (_, offset), n in zip(where, lengths, strict=True))
    tokens = torch.full((bins, width), pad_id, dtype=torch.long)
    positions = torch.zeros(bins, width, dtype=torch.long)
    rules = torch.zeros(bins, width, width, dtype=torch.bool)
    valid = torch.zeros(bins, width, dtype=torch.bool)
    noisy_slots: list[tuple[int, int]] = []
    read: list[tuple[int, int]] = []
    teacher: list[int] = []
    labels: list[int] = []
    differing = total = 0
    for (prompt, noisy, clean), (b, offset) in zip(rows, where, strict=True):
        seq, pos = list(prompt), list(range(len(prompt)))
        response = [t for block in clean for t in block]
        read.append((b, offset + len(prompt) - 1))
        labels.append(response[0])
        done = 0
        for noisy_block, clean_block in zip(noisy, clean, strict=True):
            n, start, at = len(clean_block), len(prompt) + done, offset + len(seq)
            seq += noisy_block + clean_block
            pos += list(range(start, start + n)) * 2
            for k in range(n):
                following = done + k + 1  # the response index this slot predicts
                if following < len(response):  # the last slot predicts past the end: no target
                    noisy_slots.append((b, at + k))
                    teacher.append(len(read))
                    read.append((b, at + n + k))
                    labels.append(response[following])
            differing += sum(x != y for x, y in zip(noisy_block, clean_block, strict=True))
            total += n
            done += n
        span = slice(offset, offset + len(seq))
        tokens[b, span] = torch.tensor(seq)
        positions[b, span] = torch.tensor(pos)
        valid[b, span] = True
        rules[b, span, span] = visibility.jacobi_forcing_train(len(prompt), [len(c) for c in clean], noisy_context)
    noisy_t = torch.tensor(noisy_slots, dtype=torch.long, device=device).view(-1, 2)
    read_t = torch.tensor(read, dtype=torch.long, device=device).view(-1, 2)
    return Packed(
        layout=Layout(tokens.to(device), positions.to(device), visibility.over_cache(rules, 0, valid).to(device)),
        noisy=(noisy_t[:, 0], noisy_t[:, 1]),
        read=(read_t[:, 0], read_t[:, 1]),
        teacher=torch.tensor(teacher, dtype=torch.long, device=device),
        labels=torch.tensor(labels, dtype=torch.long, device=device),
        noise=differing / max(total, 1),
        places=where,
    )


def slot_counts(rows: Sequence[tuple[list[int], list[list[int]], list[list[int]]]]) -> dict[str, int]:
    """How many slots `pack(rows)`'s two losses average over: a response of R tokens has R − 1 noisy
    slots with a next token (consistency) and R AR labels (the last prompt slot's and R − 1 clean ones)."""
    lengths = [sum(map(len, clean)) for _, _, clean in rows]
    return {"consistency": sum(n - 1 for n in lengths), "ar": sum(lengths)}


# ---- the objective ------------------------------------------------------------------------------
@register("jacobi_forcing")
@dataclass
class JacobiForcing(Objective):
    """Progressive consistency distillation on Jacobi trajectories plus an AR loss (eq. 9).

    noise_schedule: "progressive" (eq. 7), "random" or "reverse"; noise_window: w;
    noisy_context: "noisy" (Fig. 2b) or "clean" (Fig. 2a); ar_weight: w of eq. 9 (0 keeps the AR
    term as a metric without gradient); states: where noisy blocks come from (module docstring);
    block_size: n of the blocks that ground-truth responses (`--data`) are cut into.
    """

    noise_schedule: str = option("progressive", "noise within a window", choices=SCHEDULES)
    noise_window: int = option(16, "window w of eq. 7", AT_LEAST_ONE)
    noisy_context: str = option("noisy", "noisy blocks see earlier noisy or clean blocks", choices=visibility.CONTEXTS)
    ar_weight: float = option(1.0, "weight of the AR loss (eq. 9)", NON_NEGATIVE)
    states: str = option(
        "rollout",
        "noisy blocks from collected trajectories (rollout, rollout-aug: half their wrong tokens set right) "
        "or from worked solutions or --data responses with random tails (random-tail: nothing is collected)",
        choices=STATE_SOURCES,
    )
    block_size: int = option(16, "block size n that --data responses are cut into (random-tail states)", AT_LEAST_ONE)

    def noisy_blocks(
        self, example: Trajectory, ratios: Sequence[float], generator: torch.Generator, stop_ids: Sequence[int] = ()
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(noisy, clean) blocks of an example, cut after the response's first stop token, each noisy one
        at its ratio from the chosen state source (random tails are drawn over the kept tokens only)."""
        clean = [block.fixed for block in example.blocks]
        if self.states == "random-tail":
            _, clean = cut_after_stop(clean, clean, stop_ids)
            before, noisy = list(example.prompt_ids), []
            for block, ratio in zip(clean, ratios, strict=False):
                noisy.append(random_tail(before, block, ratio, generator))
                before += block
            return noisy, clean
        if example.init == REFERENCE:
            raise FastForwardError(
                f"example {example.index} is a ground-truth response without recorded Jacobi states: train it "
                "with --states random-tail, or collect trajectories with `fastforward trajectories`"
            )
        points = [choose_point(block, ratio) for block, ratio in zip(example.blocks, ratios, strict=True)]
        if self.states == "rollout-aug":
            points = [half_corrected(p, b.fixed, generator) for p, b in zip(points, example.blocks, strict=True)]
        return cut_after_stop(points, clean, stop_ids)

    def rows(self, batch: TrajectoryBatch, generator: torch.Generator, stop_ids: Sequence[int] = ()) -> list:
        """(prompt, noisy blocks, clean blocks) of each example, the noisy ones picked by the schedule.

        Blocks are cut after the response's first stop token: whole-block collection decodes past
        it, and what the model would say after its answer ends is not something to train on.
        """
        if not isinstance(batch, TrajectoryBatch):
            raise FastForwardError(
                "the jacobi_forcing objective trains on Jacobi trajectories: give --trajectories "
                "(written by `fastforward trajectories`), not --data"
            )
        out = []
        for example, g in zip(batch.examples, row_generators(batch, generator), strict=True):
            ratios = noise_ratios(len(example.blocks), self.noise_schedule, self.noise_window, g)
            out.append((example.prompt_ids, *self.noisy_blocks(example, ratios, g, stop_ids)))
        return out

    def loss(
        self, model: Model, batch: TrajectoryBatch, generator: torch.Generator, norms: Norms = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        rows = self.rows(batch, generator, model.stop_token_ids)
        lengths = [row_length(row) for row in rows]  # rows share bins: no padding between them
        capacity = bin_capacity(lengths, attention_crossover(model))
        packed = pack(rows, model.pad_token_id, self.noisy_context, model.device, capacity)
        # Only the slots a loss reads are projected to the vocabulary: noisy ones and the clean stream.
        student, clean = model.outputs_at(packed.layout, packed.noisy, packed.read)
        # θ⁻: the teacher (the clean slot's distribution) gets no gradient from the consistency term
        ar_sum, kl = head.cross_entropy_and_distillation(clean, packed.labels, student, packed.teacher)
        ar = mean_over(ar_sum, labelled(packed.labels), term_norm(norms, "ar"))
        consistency = mean_over(kl, len(student), term_norm(norms, "consistency"))
        loss = consistency + self.ar_weight * ar
        return loss, {
            "loss": loss.item(),
            "consistency_loss": consistency.item(),
            "ar_loss": ar.item(),
            "noise": packed.noise,
            "blocks": sum(len(clean_blocks) for _, _, clean_blocks in rows) / len(rows),
        }

    def counts(self, model: Model, batch: TrajectoryBatch, generator: torch.Generator) -> dict[str, int]:
        return slot_counts(self.rows(batch, generator, model.stop_token_ids))


__all__ = [
    "JacobiForcing",
    "attention_crossover",
    "bin_capacity",
    "choose_point",
    "cut_after_stop",
    "half_corrected",
    "noise_ratios",
    "pack",
    "places",
    "random_tail",
    "row_length",
    "slot_counts",
]
