"""Jacobi trajectory files: collect them from a model over prompts, store them as JSONL, serve them for training.

The decoding loop and the record types live in `fastforward.training.jacobi_trajectories`.

One JSONL line per prompt, written and flushed as soon as its batch is done:

    {"index": 0, "id": "...", "prompt": "...", "correct": true, "prompt_ids": [...], "block_size": 16,
     "init": "repeat", "blocks": [{"states": [[...n ids...], ...], "fixed": [...n ids...]}, ...]}

`states` are the iterates y⁽⁰⁾ … y⁽ᵏ⁻¹⁾ before the fixed point, in order (y⁽ᵏ⁻¹⁾ ≠ y⁽ᵏ⁾ = fixed);
`fixed` is the fixed point. `correct` is present when the prompts come from a graded task: the
response (up to its first stop token) graded against the example's reference. Training can keep
only those (`only_correct`; the Jacobi Forcing paper, §4.1, likewise keeps prompts whose
generations pass their unit tests): the AR term then never reinforces a wrong answer.

A rerun of the same command skips the prompts already written, so a killed run loses at most the
batch it was decoding; a half-written last line is cut off.

In a launch of N processes (`collect_shards`) process k decodes the prompts whose index is k mod N
into its own part file beside the output; process 0 then folds the parts into the output in prompt
order (a trajectory does not depend on the batch it is decoded in, so the file is the one a single
process writes).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from fastforward.errors import FastForwardError
from fastforward.jsonl import open_jsonl, parse_line, read_jsonl
from fastforward.model import Model
from fastforward.training.data import Example, derive_seed, encode_record, split_examples
from fastforward.training.jacobi_trajectories import DRAFT_INITS, REFERENCE, Block, Trajectory, jacobi_trajectories


# ---- reading ------------------------------------------------------------------------------------
def _scan(path: Path) -> tuple[list[Trajectory], int]:
    """The complete records of a trajectory file and the byte length they span (a torn tail is excluded)."""
    records: list[Trajectory] = []
    good = 0
    with open_jsonl(path, "trajectory file", "write one with `fastforward trajectories`") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break  # a line cut short by a killed run: ignored, and overwritten on resume
            record = parse_line(raw, path, number)
            if record is not None:
                records.append(Trajectory.from_record(record, f"{path}:{number}"))
            good += len(raw)
    return records, good


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Every complete record of a trajectory file, in prompt order."""
    path = Path(path)
    records, _ = _scan(path)
    if not records:
        raise FastForwardError(f"trajectory file {path} has no records")
    return sorted(records, key=lambda t: t.index)


# ---- writing ------------------------------------------------------------------------------------
@dataclass
class CollectSummary:
    """What a `collect` call did: prompts decoded now, found already written, and forwards spent now."""

    written: int = 0
    skipped: int = 0
    forwards: int = 0
    tokens: int = 0
    correct: int = 0  # of the prompts written now, graded correct (when a grader was given)
    path: str = ""

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


def _line(trajectory: Trajectory) -> bytes:
    return (json.dumps(trajectory.to_record(), separators=(",", ":")) + "\n").encode()


def collect(
    model: Model,
    prompts: Sequence[str | Sequence[int]],
    path: str | Path,
    *,
    block_size: int = 16,
    max_new_tokens: int = 256,
    init: str = "repeat",
    batch_size: int = 8,
    seed: int = 0,
    chat_template: bool = True,
    ids: Sequence[str] | None = None,
    progress: bool = True,
    callback: Callable[[Trajectory], None] | None = None,
    grade: Callable[[int, str], bool] | None = None,
    shard: tuple[int, int] = (0, 1),
) -> CollectSummary:
    """Write the Jacobi trajectories of `prompts` (text, or token ids) to the JSONL file `path`.

    Resumable: prompts whose index is already in the file are skipped (the file must have been
    written with the same prompts, block size and initialisation). Lines are appended and flushed
    one by one; callback(trajectory) runs after each line is written. grade(prompt index, response
    text up to its stop token) → correct, stored in the record's `correct`. shard=(k, n): only the
    prompts whose index is k mod n, written to `part_path(path, k)` (`path` is only read: the
    prompts it holds are skipped); `merge_parts(path)` folds the parts into `path`.
    """
    if init not in DRAFT_INITS:
        raise FastForwardError(f"unknown draft init {init!r}; choose one of {', '.join(DRAFT_INITS)}")
    if batch_size < 1:
        raise FastForwardError(f"batch size must be at least 1, got {batch_size}")
    if ids is not None and len(ids) != len(prompts):
        raise FastForwardError(f"got {len(ids)} ids for {len(prompts)} prompts")
    path = Path(path)
    rank, processes = shard
    target = path if processes == 1 else part_path(path, rank)
    if processes == 1:
        merge_parts(path)  # what a killed launch of several processes left
    encoded = [model.encode_prompt(p, chat_template) if isinstance(p, str) else list(p) for p in prompts]
    for i, p in enumerate(encoded):
        if not p:
            raise FastForwardError(f"prompt {i} is empty; give at least one token")
    written: dict[int, Trajectory] = {}
    good = 0
    for source in dict.fromkeys([path, target]):
        if source.exists():
            existing, size = _scan(source)
            for t in existing:
                _check_written(t, source, encoded, block_size, init)
                written[t.index] = t
            good = size if source == target else good
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = [i for i in range(len(encoded)) if i % processes == rank]
    todo = [i for i in mine if i not in written]
    summary = CollectSummary(skipped=len(mine) - len(todo), path=str(path))
    bar = tqdm(total=len(mine), initial=summary.skipped, desc=f"trajectories n={block_size}", disable=not progress)
    with target.open("r+b" if target.exists() else "wb") as f:
        f.truncate(good)  # drop a line a killed run left half-written
        f.seek(good)
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            results = jacobi_trajectories(
                model, [encoded[i] for i in chunk], block_size, max_new_tokens, init, seed, keys=chunk
            )
            for i, blocks in zip(chunk, results, strict=True):
                traj = Trajectory(
                    prompt_ids=encoded[i],
                    blocks=blocks,
                    block_size=block_size,
                    index=i,
                    init=init,
                    prompt=prompts[i] if isinstance(prompts[i], str) else None,
                    id=None if ids is None else str(ids[i]),
                )
                if grade is not None:
                    traj.correct = bool(grade(i, model.decode(traj.answer(model.stop_token_ids))))
                    summary.correct += traj.correct
                f.write(_line(traj))
                f.flush()
                os.fsync(f.fileno())
                summary.written += 1
                summary.forwards += traj.forwards
                summary.tokens += len(traj.response)
                bar.update(1)
                if callback is not None:
                    callback(traj)
            bar.set_postfix(tpf=f"{summary.tokens_per_forward:.2f}")
    bar.close()
    return summary


def _check_written(t: Trajectory, path: Path, encoded: list[list[int]], block_size: int, init: str) -> None:
    """Refuse a record already in `path` that this collection would not have written."""
    if t.index >= len(encoded) or t.prompt_ids != encoded[t.index]:
        raise FastForwardError(
            f"{path} holds a trajectory for prompt {t.index} that is not among the prompts given "
            "(different prompts, order or tokenizer); choose another output file"
        )
    if t.block_size != block_size or t.init != init:
        raise FastForwardError(
            f"{path} was written with block size {t.block_size} and init {t.init!r}, not {block_size} "
            f"and {init!r}; choose another output file"
        )


def part_path(path: str | Path, rank: int) -> Path:
    """Where process `rank` of a sharded collection writes its trajectories, beside `path`."""
    path = Path(path)
    return path.with_name(f"{path.name}.part-{rank}")


def merge_parts(path: str | Path) -> None:
    """Fold the part files of a sharded collection (finished, or left by a killed launch) into `path`:
    every prompt once, in prompt order, then the parts are deleted."""
    path = Path(path)
    parts = sorted(path.parent.glob(f"{glob.escape(path.name)}.part-*"))
    if not parts:
        return
    records = {t.index: t for source in (path, *parts) if source.exists() for t in _scan(source)[0]}
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.writelines(_line(records[i]) for i in sorted(records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for part in parts:
        part.unlink()


# ---- serving them for training ------------------------------------------------------------------
@dataclass
class TrajectoryBatch:
    """Trajectories of one training batch (plain ids: the objective builds the layout on its device);
    `ids`: each example's place in the data stream (default 0..B-1), which seeds its random draws."""

    examples: list[Trajectory]
    ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.ids is None:
            self.ids = list(range(len(self.examples)))

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        return self

    @property
    def n_tokens(self) -> int:
        """Tokens in the packed rows: the prompt plus a noisy and a clean copy of every block."""
        return sum(len(t.prompt_ids) + 2 * len(t.response) for t in self.examples)


def fit(trajectory: Trajectory, seq_len: int) -> Trajectory:
    """The leading blocks that fit `[prompt, noisy₁, clean₁, …]` into seq_len tokens.

    Without room for one block, the prompt keeps only its last tokens.
    """
    n = trajectory.block_size
    if 2 * n + 1 > seq_len:
        raise FastForwardError(
            f"seq_len {seq_len} cannot hold a prompt token and a noisy and a clean block of {n}; "
            f"raise --seq-len to at least {2 * n + 1}"
        )
    prompt = trajectory.prompt_ids
    keep = max(1, min(len(trajectory.blocks), (seq_len - len(prompt)) // (2 * n)))
    if len(prompt) + 2 * n * keep > seq_len:
        prompt = prompt[len(prompt) + 2 * n * keep - seq_len :]
    return replace(trajectory, prompt_ids=prompt, blocks=trajectory.blocks[:keep])


def only_correct(trajectories: Sequence[Trajectory], where: str) -> list[Trajectory]:
    """The trajectories whose response was graded correct; every one must carry a grade."""
    ungraded = sum(t.correct is None for t in trajectories)
    if ungraded:
        raise FastForwardError(
            f"{ungraded} of {len(trajectories)} trajectories in {where} carry no grade: collect them from a "
            "task (`fastforward trajectories --task NAME`) to grade them, or train without --only-correct"
        )
    kept = [t for t in trajectories if t.correct]
    if not kept:
        raise FastForwardError(f"no trajectory in {where} was graded correct: nothing to train on")
    return kept


class TrajectoryData:
    """Trajectories fitted to rows of at most `seq_len` packed tokens, served like `PackedData`.

    The batch for a given index is a pure function of (seed, index): epoch e visits the examples in
    a permutation seeded by (seed, e), so a resumed run sees the same batches.
    """

    def __init__(self, trajectories: Sequence[Trajectory], seq_len: int):
        if not trajectories:
            raise FastForwardError("no trajectories to train on")
        self.seq_len = seq_len
        self.examples = [fit(t, seq_len) for t in trajectories if t.blocks]
        if not self.examples:
            raise FastForwardError("every trajectory is empty (no blocks)")

    @classmethod
    def from_file(cls, path: str | Path, seq_len: int, correct_only: bool = False) -> TrajectoryData:
        trajectories = read_trajectories(path)
        return cls(only_correct(trajectories, str(path)) if correct_only else trajectories, seq_len)

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, index: int, batch_size: int, seed: int) -> TrajectoryBatch:
        n = len(self)
        samples = range(index * batch_size, (index + 1) * batch_size)
        orders = {epoch: self._order(seed, epoch) for epoch in {s // n for s in samples}}
        return TrajectoryBatch([self.examples[int(orders[s // n][s % n])] for s in samples], list(samples))

    def in_order(self, batch_size: int) -> Iterator[TrajectoryBatch]:
        for start in range(0, len(self), batch_size):
            chosen = self.examples[start : start + batch_size]
            yield TrajectoryBatch(chosen, list(range(start, start + len(chosen))))

    def _order(self, seed: int, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))

    def fingerprint(self) -> str:
        """A hash of the fitted trajectories: a resumed run must see the same data."""
        h = hashlib.sha256()
        for t in self.examples:
            h.update(_line(t))
        return h.hexdigest()[:16]


def from_examples(examples: Sequence[Example], block_size: int, pad_id: int) -> list[Trajectory]:
    """Ground-truth responses as trajectories without iterates (`init` "reference"): a record's context
    is the prompt, its target tokens the response, cut into blocks of `block_size` (the last one padded
    with `pad_id`, which training cuts off after the stop token). For states that need no rollout
    (the jacobi_forcing objective's "random-tail")."""
    if block_size < 1:
        raise FastForwardError(f"the block size must be at least 1, got {block_size}")
    out = []
    for index, example in enumerate(examples):
        start = next((i for i, target in enumerate(example.targets) if target), len(example.ids))
        prompt, response = example.ids[:start], example.ids[start:]
        if not prompt or not response:
            raise FastForwardError(f"example {index} needs a prompt and a completion to train Jacobi Forcing on")
        response = response + [pad_id] * (-len(response) % block_size)
        blocks = [Block([], response[i : i + block_size]) for i in range(0, len(response), block_size)]
        out.append(Trajectory(prompt, blocks, block_size, index=index, init=REFERENCE))
    return out


def trajectory_datasets(
    path: str | Path | None,
    seq_len: int,
    eval_path: str | Path | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    correct_only: bool = False,
) -> tuple[TrajectoryData, TrajectoryData | None]:
    """Training data (and held-out data: a second file, or a seeded share of the first) from trajectory
    files; correct_only keeps the trajectories graded correct."""
    if not path:
        raise FastForwardError(
            "the jacobi_forcing objective trains on Jacobi trajectories: give --trajectories FILE "
            "(write one with `fastforward trajectories`)"
        )
    records = read_trajectories(path)
    held = read_trajectories(eval_path) if eval_path else None
    if correct_only:
        records = only_correct(records, str(path))
        held = only_correct(held, str(eval_path)) if held else None
    if held is None and eval_fraction:
        records, held = split_examples(records, eval_fraction, seed)  # type: ignore[arg-type]
    return TrajectoryData(records, seq_len), TrajectoryData(held, seq_len) if held else None


# ---- prompts ------------------------------------------------------------------------------------
def read_prompts(path: str | Path) -> tuple[list[str], list[str], list[str] | None]:
    """Prompts, ids and completions of a JSONL file of {"prompt": ..., ...} records ("id" is kept, else the
    count so far; the completions are None unless every record has a non-empty string "completion"; other
    keys are ignored)."""
    prompts, ids, completions = [], [], []
    for number, record in read_jsonl(path, "prompt file", 'give a JSONL file of {"prompt": ...} lines'):
        if not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise FastForwardError(f'{path}:{number}: expected an object with a non-empty string "prompt"')
        prompts.append(record["prompt"])
        ids.append(str(record.get("id", len(ids))))
        completions.append(record.get("completion"))
    complete = all(isinstance(c, str) and c for c in completions)
    return prompts, ids, completions if complete else None


@dataclass
class PromptSource:
    """Prompts to collect trajectories for, and their ids; from a task, also its budget and grader."""

    prompts: list[str]
    ids: list[str]
    completions: list[str] | None = None  # reference responses (a task's worked solutions), where known
    max_new_tokens: int | None = None
    grade: Callable[[int, str], bool] | None = None  # (prompt index, response text) → correct

    def references(self, tokenizer, block_size: int, pad_id: int, chat_template: bool = True) -> list[Trajectory]:
        """The reference responses as trajectories without iterates (`from_examples`)."""
        if self.completions is None:
            raise FastForwardError(
                "training on reference responses needs them: a --task whose examples have worked solutions, "
                'or a --prompts file whose every line has a "completion"'
            )
        records = [{"prompt": p, "completion": c} for p, c in zip(self.prompts, self.completions, strict=True)]
        return from_examples([encode_record(r, tokenizer, chat_template) for r in records], block_size, pad_id)


def task_prompts(
    task: str, n: int | None = None, split: str = "train", seed: int = 0, options: dict | None = None
) -> PromptSource:
    """The prompts of a task's examples (e.g. arithmetic's train split), with the task's grader."""
    from fastforward.tasks import get_task

    chosen = get_task(task, **(options or {}))
    examples = chosen.examples(split, n, seed)
    if not examples:
        raise FastForwardError(f"task {task!r} gave no {split} examples")

    def grade(index: int, text: str) -> bool:
        return chosen.grade(examples[index], text).correct

    completions = [e.completion for e in examples]
    known = completions if all(c is not None for c in completions) else None
    return PromptSource([e.prompt for e in examples], [e.id for e in examples], known, chosen.max_new_tokens, grade)


@dataclass(frozen=True)
class Collection:
    """How trajectories are collected from a `PromptSource` (the settings of `collect`)."""

    max_new_tokens: int | None = None  # None: the source's budget, else 256 (rounded up to whole blocks)
    init: str = "repeat"
    batch_size: int = 8
    seed: int = 0
    chat_template: bool = True


def collect_from(
    model: Model,
    source: PromptSource,
    collection: Collection,
    path: str | Path,
    block_size: int,
    shard: tuple[int, int] = (0, 1),
) -> CollectSummary:
    """`collect` over the prompts of `source` (those of `shard`), with their ids and grader."""
    return collect(
        model,
        source.prompts,
        path,
        block_size=block_size,
        max_new_tokens=collection.max_new_tokens or source.max_new_tokens or 256,
        init=collection.init,
        batch_size=collection.batch_size,
        seed=collection.seed,
        chat_template=collection.chat_template,
        ids=source.ids,
        grade=source.grade,
        shard=shard,
        progress=shard[0] == 0,
    )


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


def describe(summary: CollectSummary, graded: bool) -> str:
    """What a collection did: tokens per forward, and how many responses were graded correct."""
    text = f"{summary.tokens_per_forward:.2f} tokens per Jacobi forward"
    if graded and summary.written:
        text += f"; {summary.correct} of {summary.written} responses graded correct"
    return text
