"""Progressive Jacobi Forcing: rounds of trajectory collection and training, with growing blocks.

Round r collects the Jacobi trajectories of the previous round's model (round 1: `start`) at block
size n_r into OUT/trajectories-round-r.jsonl, then trains that model on them into OUT/round-r (a
trainer run directory; its final model is what round r+1 starts from). With the objective's
"random-tail" states a round collects nothing: it trains on the source's reference responses (a
task's worked solutions) cut into blocks of n_r. Calling again with the same
arguments resumes: finished rounds are skipped, a trajectory file is completed, an unfinished
training run continues from its last checkpoint. `fastforward jacobi-forcing` and the demo's zoo
recipe both run this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from fastforward.errors import FastForwardError
from fastforward.model import load_model
from fastforward.training.launch import launched_processes
from fastforward.training.objectives import JacobiForcing
from fastforward.training.run_dir import finished_run
from fastforward.training.trainer import TrainConfig, train
from fastforward.training.trajectories.dataset import TrajectoryData
from fastforward.training.trajectories.sources import Collection, PromptSource, collect_from
from fastforward.training.trajectories.writer import describe


@dataclass(frozen=True)
class Round:
    """One round's block size n (trajectories) and noise window w (training)."""

    block_size: int
    noise_window: int


def per_round(values: list[int], rounds: int, name: str) -> list[int]:
    """One value per round: as given, or the last value repeated for the remaining rounds."""
    if len(values) > rounds:
        raise FastForwardError(f"{name} has {len(values)} values for {rounds} rounds")
    return values + [values[-1]] * (rounds - len(values))


def progressive_rounds(
    start: str,
    out: str | Path,
    source: PromptSource,
    rounds: list[Round],
    objective: JacobiForcing,
    config: TrainConfig,
    collection: Collection,
    *,
    dtype: str = "float32",
    only_correct: bool = False,
    log: Callable[[str], None] = print,
) -> str:
    """Run (or resume) every round; returns the final model's directory. `objective` gives the
    schedule, context and AR weight; each round trains with its own noise window."""
    if not rounds:
        raise FastForwardError("progressive Jacobi Forcing needs at least one round")
    if launched_processes() > 1:
        raise FastForwardError(
            "progressive Jacobi Forcing runs in one process (every process would write the same trajectory "
            "file); launch its stages instead: `torchrun ... -m fastforward trajectories` and `torchrun ... "
            "-m fastforward train --objective jacobi_forcing`, round by round"
        )
    out = Path(out)
    for r, spec in enumerate(rounds, start=1):
        run_dir = out / f"round-{r}"
        if finished_run(run_dir):
            log(f"round {r}: done ({run_dir})")
            start = str(run_dir)
            continue
        model = load_model(start, dtype=dtype)
        if objective.states == "random-tail":  # states drawn from the references: nothing to collect
            references = source.references(
                model.tokenizer, spec.block_size, model.pad_token_id, collection.chat_template
            )
            data = TrajectoryData(references, config.seq_len)
            what = f"reference responses in blocks of {spec.block_size}"
        else:
            path = out / f"trajectories-round-{r}.jsonl"
            log(f"round {r}: trajectories of {start} at block size {spec.block_size} → {path}")
            summary = collect_from(model, source, collection, path, spec.block_size)
            if summary.written:
                log(f"round {r}: {describe(summary, source.grade is not None)}")
            data = TrajectoryData.from_file(path, config.seq_len, only_correct)
            what = "trajectories"
        log(f"round {r}: training on {len(data)} {what} (window {spec.noise_window}) → {run_dir}")
        train(model, replace(objective, noise_window=spec.noise_window), data, config, run_dir)
        start = str(run_dir)
    return start
