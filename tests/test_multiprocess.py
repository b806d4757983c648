"""Several processes: a torchrun launch of 2 CPU processes (gloo) trains the model one process trains, for
every objective; a killed launch resumes exactly; launches that would train alone fail clearly; a trajectory
collection shares its prompts out and writes the file one process writes. In process: however a step's rows
are split into micro-batches, the update is the same."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import Stop, crash_at

from fastforward.cli import main
from fastforward.errors import FastForwardError
from fastforward.model.tiny import tiny_model
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import OBJECTIVES, JacobiForcing, make_objective
from fastforward.training.objectives.base import labelled
from fastforward.training.objectives.jacobi_forcing import pack, slot_counts
from fastforward.training.rounds import Round, progressive_rounds
from fastforward.training.trainer import TrainConfig, train
from fastforward.training.trajectories.dataset import TrajectoryData
from fastforward.training.trajectories.records import read_trajectories
from fastforward.training.trajectories.sources import Collection, PromptSource
from fastforward.training.trajectories.writer import collect, merge_parts

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Tom has 3 apples and buys 5 more. 3 + 5 = 8\n",
    "The quick brown fox jumps over the lazy dog.\n",
]
PROMPTS = [*TEXTS, "Tom has", "def add(", "The quick"]
# Four steps with a checkpoint after the second; fp32 weights; one thread per process. The first step's learning
# rate is 0 (--warmup 1): Adam's first update, lr·g/(|g| + ε), would turn the summation noise of the few gradients
# near ε into differences of up to 8e-6 (measured), too close to TOLERANCE.
FLAGS = ["--steps", "4", "--seq-len", "32", "--lr", "3e-3", "--warmup", "1", "--save-every", "2", "--threads", "1"]
FLAGS += ["--no-bf16"]  # as the launches train beside a GPU they hide (the CLI's default there is bf16)
TOLERANCE = 1e-5  # fp32: the processes sum the same terms in another order
# Jacobi Forcing's default schedule draws nothing: train it on randomly drawn noise ratios.
JACOBI_FORCING = {"noise_schedule": "random", "noise_window": 2}


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The runs in this process train on the CPU too, as the launches do (they hide any GPU)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A saved tiny model, text data and Jacobi trajectories of the model."""
    root = tmp_path_factory.mktemp("multiprocess")
    model = tiny_model(TEXTS)
    model.save(root / "base")
    (root / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 8))
    # Random drafts: every block's trajectory has points before its fixed point, for the noise to choose from.
    collect(model, PROMPTS, root / "t.jsonl", block_size=4, max_new_tokens=8, init="random", progress=False)
    return root


def data_flags(root: Path, objective: str) -> list[str]:
    if objective == "jacobi_forcing":
        options = [f"--{k.replace('_', '-')}={v}" for k, v in JACOBI_FORCING.items()]
        return ["--trajectories", str(root / "t.jsonl"), *options]
    return ["--data", str(root / "d.jsonl")]


def train_args(root: Path, objective: str, out: Path, batch_size: int) -> list[str]:
    model = ["--objective", objective, "--model", str(root / "base"), *data_flags(root, objective)]
    return ["train", *model, "--out", str(out), "--batch-size", str(batch_size), *FLAGS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*command: str) -> subprocess.CompletedProcess:
    """Run a launch command with one thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # a CPU group, also beside a GPU
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


def torchrun(*args: str, script: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node 2 -m fastforward ARGS` (or `script ARGS`)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    target = ["-m", "fastforward"] if script is None else [str(script)]
    return launch(*launcher, "--master_port", str(free_port()), *target, *args)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def metrics(run: Path) -> list[dict]:
    """The run's records without the timing."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]


@pytest.fixture(scope="module")
def two_process_run(inputs) -> Callable[[str], Path]:
    """The run directory of a 2-process launch (batch 2 each) of an objective, launched once per module."""
    runs: dict[str, Path] = {}

    def run(objective: str) -> Path:
        if objective not in runs:
            out = inputs / f"two-{objective}"
            launched = torchrun(*train_args(inputs, objective, out, batch_size=2))
            assert launched.returncode == 0, launched.stderr
            assert launched.stdout.count("saved the model in") == 1, launched.stdout  # process 0 alone speaks
            runs[objective] = out
        return runs[objective]

    return run


# ---- torchrun: 2 processes ----------------------------------------------------------------------
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_two_processes_train_the_model_one_process_does(inputs, two_process_run, objective):
    two = two_process_run(objective)
    one = inputs / f"one-{objective}"
    assert main(train_args(inputs, objective, one, batch_size=4)) == 0
    difference = max_difference(load_file(one / "model.safetensors"), load_file(two / "model.safetensors"))
    print(f"{objective}: max |weight, 2 processes × batch 2 − 1 process × batch 4| = {difference:.1e}")
    assert difference < TOLERANCE
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert step_figures(b) == pytest.approx(step_figures(a), rel=1e-4, abs=1e-6)


def step_figures(record: dict) -> dict[str, float]:
    """What a step's record says of the whole step: its losses (means over the step's tokens), token count,
    gradient norm, learning rate and shared draws (the others describe a micro-batch on average)."""
    whole_step = ("step", "tokens", "grad_norm", "lr", "block")
    return {k: v for k, v in record.items() if k.endswith("loss") or k in whole_step}


KILL_AFTER_FIRST_CHECKPOINT = """
import os, sys
from fastforward.cli import main
from fastforward.training import run_dir

save = run_dir.save_checkpoint

def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    os._exit(137)  # as if killed right after the checkpoint: no cleanup runs

run_dir.save_checkpoint = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_model(inputs, two_process_run, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_AFTER_FIRST_CHECKPOINT)
    out = tmp_path / "run"
    args = train_args(inputs, "sbd", out, batch_size=2)
    killed = torchrun(*args, script=script)
    assert killed.returncode != 0 and not (out / "config.json").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    resumed = torchrun(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("resuming") + resumed.stderr.count("resuming") == 1
    straight = two_process_run("sbd")
    ours, theirs = load_file(out / "model.safetensors"), load_file(straight / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert metrics(out) == metrics(straight)


def test_a_run_directory_refused_by_process_0_is_reported_once(inputs, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a run")
    failed = torchrun(*train_args(inputs, "ntp", foreign, batch_size=2))
    assert failed.returncode != 0
    assert failed.stderr.count("fastforward train: error:") == 1
    assert "not a fastforward run directory" in failed.stderr
    # no traceback from any process (torchrun adds its own summary)
    assert "trainer.py" not in failed.stderr and "run_dir.py" not in failed.stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_accelerate_launch_on_the_cpu_launcher_fails_instead_of_training_alone(inputs, tmp_path, monkeypatch, capsys):
    # What `accelerate launch --cpu --num_processes 2` (accelerate 1.15) gives the one process it starts.
    for name, value in {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert main(train_args(inputs, "ntp", tmp_path / "run", batch_size=2)) == 2
    error = capsys.readouterr().err
    assert "`accelerate launch` was asked for several processes but started one" in error
    assert "torchrun --nproc_per_node N" in error and "--multi_gpu" in error
    assert not (tmp_path / "run").exists()


# ---- one process: the split of a step's rows ----------------------------------------------------
def dataset(root: Path, objective: str, model) -> PackedData | TrajectoryData:
    if objective == "jacobi_forcing":
        return TrajectoryData(read_trajectories(root / "t.jsonl"), seq_len=32)
    return PackedData([encode_record({"text": t}, model.tokenizer) for t in TEXTS * 8], 32, model.pad_token_id)


def config(**overrides) -> TrainConfig:
    base = dict(steps=4, seq_len=32, batch_size=4, lr=3e-3, warmup=1, save_every=2, eval_every=0)
    return TrainConfig(**{**base, **overrides})


def trained(root: Path, objective: str, out: Path, callback=None, **overrides) -> dict[str, torch.Tensor]:
    model = tiny_model(TEXTS)
    objective = make_objective(objective, **JACOBI_FORCING)
    train(model, objective, dataset(root, objective.name, model), config(**overrides), out, callback=callback)
    return {k: v.detach().clone() for k, v in model.hf.named_parameters()}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_micro_batches_train_the_model_one_batch_does(inputs, tmp_path, objective):
    whole = trained(inputs, objective, tmp_path / "whole")
    for batch_size, grad_accum in ((2, 2), (1, 4)):
        split = trained(inputs, objective, tmp_path / f"{batch_size}", batch_size=batch_size, grad_accum=grad_accum)
        assert max_difference(whole, split) < TOLERANCE, (batch_size, grad_accum)


def test_a_run_resumes_with_another_split_of_the_same_rows_and_refuses_other_rows(inputs, tmp_path):
    whole = trained(inputs, "sbd", tmp_path / "whole")
    with pytest.raises(Stop):
        trained(inputs, "sbd", tmp_path / "run", crash_at(2), batch_size=2, grad_accum=2)
    with pytest.raises(FastForwardError, match="rows_per_step: 4 → 8"):
        trained(inputs, "sbd", tmp_path / "run", batch_size=8)
    assert max_difference(whole, trained(inputs, "sbd", tmp_path / "run")) < TOLERANCE


def test_jacobi_forcing_counts_are_the_slots_its_losses_average_over(inputs):
    model = tiny_model(TEXTS)
    batch = dataset(inputs, "jacobi_forcing", model).batch(0, 4, seed=0)
    rows = JacobiForcing(**JACOBI_FORCING).rows(batch, torch.Generator().manual_seed(0), model.stop_token_ids)
    packed = pack(rows, model.pad_token_id)
    assert slot_counts(rows) == {"consistency": len(packed.teacher), "ar": labelled(packed.labels)}


def test_fsdp_where_accelerate_cannot_shard_is_refused(inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --use_fsdp` sets
    with pytest.raises(FastForwardError, match="accelerate shards models only on GPUs"):
        trained(inputs, "ntp", tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---- trajectories: the prompts shared out -------------------------------------------------------
COLLECT = {"block_size": 3, "max_new_tokens": 9, "init": "random", "batch_size": 4, "progress": False}


def test_shards_of_a_collection_fold_into_the_file_one_process_writes(tmp_path):
    model = tiny_model(TEXTS, init_std=0.5)  # well-separated predictions: no near-tie turns on the batch
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    collect(model, PROMPTS, one, **COLLECT)
    for rank in (1, 0):
        assert collect(model, PROMPTS, two, **COLLECT, shard=(rank, 2)).written == 3
    assert not two.exists() and len(list(tmp_path.glob("two.jsonl.part-*"))) == 2
    merge_parts(two)
    assert two.read_bytes() == one.read_bytes() and not list(tmp_path.glob("*.part-*"))
    collect(model, PROMPTS, tmp_path / "left.jsonl", **COLLECT, shard=(1, 2))  # a killed launch's part
    summary = collect(model, PROMPTS, tmp_path / "left.jsonl", **COLLECT)  # one process takes over
    assert (summary.skipped, summary.written) == (3, 3)
    assert read_trajectories(tmp_path / "left.jsonl") == read_trajectories(one)  # appended: another line order


def test_torchrun_shares_the_prompts_of_a_trajectory_collection(tmp_path, capsys):
    tiny_model(TEXTS, init_std=0.5).save(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    args = ["trajectories", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--block-size", "3"]
    args += ["--max-new-tokens", "9", "--init", "random", "--threads", "1"]
    launched = torchrun(*args, "--out", str(tmp_path / "two.jsonl"))
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.count("6 prompts written, 0 already there") == 1, launched.stdout
    assert main([*args, "--out", str(tmp_path / "one.jsonl")]) == 0
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "one.jsonl", "p.jsonl", "two.jsonl"]


def test_progressive_jacobi_forcing_refuses_a_launch_of_several_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    source, spec = PromptSource(["Tom has"], ["0"]), [Round(block_size=2, noise_window=2)]
    with pytest.raises(FastForwardError, match="runs in one process"):
        progressive_rounds("unused", tmp_path, source, spec, JacobiForcing(), TrainConfig(), Collection())
    assert not any(tmp_path.iterdir())


# ---- eval: the batches shared out -----------------------------------------------------------------
def test_torchrun_shares_the_batches_of_an_eval(tmp_path):
    """`torchrun ... -m fastforward eval`: each process decodes its share of the batches; process 0
    writes the records in input order and the figures one process gives (tokens/s aside)."""
    model = tiny_model(TEXTS, init_std=0.5)
    model.add_mask_token()
    model.save(tmp_path / "m")
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in PROMPTS))
    args = ["eval", "--model", str(tmp_path / "m"), "--task", str(task), "--decoder", "jacobi", "--block-size", "3"]
    args += ["--max-new-tokens", "9", "--batch-size", "2", "--quiet", "--threads", "1", "--no-chat-template"]
    launched = torchrun(*args, "--out", str(tmp_path / "two"))
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.count("TPF") == 1, launched.stdout  # process 0 alone prints
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    timing = {"seconds", "prefill_seconds", "tps", "ar_tps", "speedup"}
    for a, b in zip(one["results"], two["results"], strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    records = [(tmp_path / d / "records.jsonl").read_text().splitlines() for d in ("one", "two")]
    assert records[0] == records[1] and len(records[0]) == 2 * len(PROMPTS)


# ---- FSDP2 on the CPU --------------------------------------------------------------------------------
FSDP_STEPS = """
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from fastforward.model.tiny import tiny_model
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import make_objective
from fastforward.training.trainer import _ObjectiveModule

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
model = tiny_model(seed=0)
objective = make_objective(sys.argv[2])
objective.setup(model)
root = _ObjectiveModule(model, objective)
if world > 1:  # as accelerate's FSDP2 plugin wraps the trainer's module: each layer, then the root
    for layer in model.hf.model.layers:
        fully_shard(layer)
    fully_shard(root)
optimizer = torch.optim.AdamW(root.parameters(), lr=1e-3)
texts = %r
data = PackedData([encode_record({"text": t}, model.tokenizer) for t in texts * 8], 24, model.pad_token_id)
rows = 4 // world
for step in range(3):  # the trainer's step: process p takes micro-batch step * world + p of `rows` rows
    batches = [data.batch(step * world + p, rows, 0) for p in range(world)]
    seed = torch.Generator().manual_seed(step)
    counts = [root.counts(b, torch.Generator().manual_seed(step)) for b in batches]
    norms = {k: max(sum(c[k] for c in counts), 1) / world for k in counts[0]}
    loss, _ = root(batches[rank], torch.Generator().manual_seed(step), norms)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
state = get_model_state_dict(model.hf, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    torch.save({k: v.clone() for k, v in state.items()}, sys.argv[1])
if world > 1:
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("objective", ["sbd", "setdlm"])
def test_fsdp2_on_cpu_trains_the_model_one_process_does(tmp_path, objective):
    """torch's FSDP2 (`fully_shard`) runs on CPUs over gloo, though accelerate shards only on GPUs: two
    processes, each holding half of every parameter, train the model one process trains (3 steps)."""
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_STEPS % (TEXTS,))
    sharded = torchrun(str(tmp_path / "two.pt"), objective, script=script)
    assert sharded.returncode == 0, sharded.stderr
    alone = launch(sys.executable, str(script), str(tmp_path / "one.pt"), objective)
    assert alone.returncode == 0, alone.stderr
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert max_difference(one, two) < 1e-5
    start = tiny_model(seed=0).hf.state_dict()
    moved = [(one[k] - v).abs().max().item() for k, v in start.items() if k in one and v.shape == one[k].shape]
    assert max(moved) > 1e-3  # the steps did train
