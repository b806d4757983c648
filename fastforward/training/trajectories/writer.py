"""Writing trajectory files (`records`): `collect` decodes prompts with the `jacobi` decoder (`rollout`)
and appends each prompt's line, written and flushed as soon as its batch is done.

A rerun of the same command skips the prompts already written, so a killed run loses at most the
batch it was decoding; a half-written last line is cut off.

A collection shared by N processes (`shards`) has process k decode the prompts whose index is k mod N
into its own part file beside the output (`part_path`); `merge_parts` then folds the parts into the
output in prompt order (a trajectory does not depend on the batch it is decoded in, so the file is
the one a single process writes).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.training.trajectories.records import Trajectory, line, scan
from fastforward.training.trajectories.rollout import jacobi_decoder, rollouts


@dataclass
class CollectSummary:
    """What a `collect` call did: prompts decoded now, found already written, and the decoder's forwards
    and the tokens of whole blocks they gave now."""

    written: int = 0
    skipped: int = 0
    forwards: int = 0
    tokens: int = 0
    correct: int = 0  # of the prompts written now, graded correct (when a grader was given)
    path: str = ""

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


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
    """Write the Jacobi trajectories of `prompts` (text, or token ids) to the JSONL file `path`: the
    `jacobi` decoder's run with blocks of `block_size`, fresh drafts filled as `init` says, random ones
    keyed by `seed` (`rollout`).

    Resumable: prompts whose index is already in the file are skipped (the file must have been
    written with the same prompts, block size and initialisation). Lines are appended and flushed
    one by one; callback(trajectory) runs after each line is written. grade(prompt index, response
    text up to its stop token) → correct, stored in the record's `correct`. shard=(k, n): only the
    prompts whose index is k mod n, written to `part_path(path, k)` (`path` is only read: the
    prompts it holds are skipped); `merge_parts(path)` folds the parts into `path`.
    """
    decoder = jacobi_decoder(block_size, init, seed)  # refuses a bad block size or init before any work
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
            existing, size = scan(source)
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
            decoded = rollouts(model, decoder, [encoded[i] for i in chunk], max_new_tokens)
            for i, rollout in zip(chunk, decoded, strict=True):
                traj = Trajectory(
                    prompt_ids=encoded[i],
                    blocks=rollout.blocks,
                    block_size=block_size,
                    index=i,
                    init=init,
                    prompt=prompts[i] if isinstance(prompts[i], str) else None,
                    id=None if ids is None else str(ids[i]),
                )
                if grade is not None:
                    traj.correct = bool(grade(i, model.decode(traj.answer(model.stop_token_ids))))
                    summary.correct += traj.correct
                f.write(line(traj))
                f.flush()
                os.fsync(f.fileno())
                summary.written += 1
                summary.forwards += rollout.forwards
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
    records = {t.index: t for source in (path, *parts) if source.exists() for t in scan(source)[0]}
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.writelines(line(records[i]) for i in sorted(records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for part in parts:
        part.unlink()


def describe(summary: CollectSummary, graded: bool) -> str:
    """What a collection did: tokens per forward, and how many responses were graded correct."""
    text = f"{summary.tokens_per_forward:.2f} tokens per Jacobi forward"
    if graded and summary.written:
        text += f"; {summary.correct} of {summary.written} responses graded correct"
    return text
