"""The demo's model zoo: one recipe that trains every shipped checkpoint, provenance, and packing.

Every checkpoint starts from the same NTP-pretrained small llama on the `arithmetic` task (the
demo's model and task, `fastforward.demo.pipeline`), and each stage is one call of the demo's trainer:

    pretrain  fresh model, NTP on whole problems            3000 steps, LR 2e-3
    ntp       pretrain → NTP fine-tune (the baseline)         2400 steps, LR 2e-3
    sbd       pretrain → SBD fine-tune                        2400 steps, LR 2e-3
    multitf   sbd → MultiTF post-training (max group 3,         400 steps, LR 1e-4 (a low LR: the SBD
              blocks of 6, the fresh-tail schedule)                stage ended its cosine near 0)
    setdlm    pretrain → SetDLM fine-tune (set 4, window 8)   2400 steps, LR 2e-3, NTP term 1
    jf        ntp → one Jacobi Forcing round (block 16) on the trajectories of 8000 training prompts
              (the correct ones), 2400 steps of batch 8 at LR 1e-3 (`fastforward jacobi-forcing`)

`fastforward demo --retrain` runs them all (`train_zoo`); `pack` writes a trained directory as a
shipped checkpoint: bf16 safetensors, tokenizer, config (which records its task options) and
`provenance.json` (the recipe, the command, the git commit, seconds and machine, final losses, the
sha256 of the weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fastforward.cpu.threads import cpu_model
from fastforward.demo.pipeline import DemoConfig, finetune, pretrain
from fastforward.errors import FastForwardError
from fastforward.model import load_model
from fastforward.training.objectives import JacobiForcing
from fastforward.training.rounds import Round, progressive_rounds
from fastforward.training.trainer import TrainConfig
from fastforward.training.trajectories.sources import Collection, task_prompts

TASK_FILE = "fastforward_task.json"  # the task options a checkpoint was trained for (read by `eval`)
CONFIG_OPTIONS = ("min_block", "max_block")  # a stage's options that set the demo config's training blocks


@dataclass(frozen=True)
class Stage:
    name: str
    base: str | None  # the stage it starts from (None: a fresh model)
    objective: str
    steps: int
    lr: float
    options: dict[str, Any] = field(default_factory=dict)
    ntp_weight: float = 1.0

    @property
    def description(self) -> str:
        """One line of what the stage made (`fastforward models` shows it)."""
        start = f"from its {self.base} stage" if self.base else "from scratch"
        return f"the demo's small llama for arithmetic: {self.objective} {start}, {self.steps} steps"


MULTITF_BLOCKS = {"min_block": 6, "max_block": 6}  # the demo's mbd decodes blocks of 6
RECIPE: tuple[Stage, ...] = (
    Stage("pretrain", None, "ntp", 3000, 2e-3),
    Stage("ntp", "pretrain", "ntp", 2400, 2e-3),
    Stage("sbd", "pretrain", "sbd", 2400, 2e-3),
    Stage("multitf", "sbd", "multitf", 400, 1e-4, {"max_group": 3, "schedule": "fresh-tail", **MULTITF_BLOCKS}),
    Stage("setdlm", "pretrain", "setdlm", 2400, 2e-3, {"set_size": 4.0, "max_set": 8.0}),
    Stage("jf", "ntp", "jacobi_forcing", 2400, 1e-3, {"prompts": 8000, "block_size": 16, "batch_size": 8}),
)


def train_stage(stage: Stage, out: Path, config: DemoConfig | None = None, log: Callable[[str], None] = print) -> float:
    """Train one stage into out/<name> (a killed run resumes); returns its seconds."""
    config = config or DemoConfig()
    started = time.perf_counter()
    if stage.objective == "jacobi_forcing":
        jacobi_forcing(stage, out, config, log)
    elif stage.base is None:
        pretrain(replace(config, pretrain_steps=stage.steps, pretrain_lr=stage.lr), out / stage.name, log)
    else:
        blocks = {k: v for k, v in stage.options.items() if k in CONFIG_OPTIONS}
        options = {k: v for k, v in stage.options.items() if k not in CONFIG_OPTIONS}
        tuned = replace(config, finetune_steps=stage.steps, finetune_lr=stage.lr, ntp_weight=stage.ntp_weight, **blocks)
        finetune(tuned, out / stage.base, out / stage.name, stage.objective, log, **options)
    write_task_options(out / stage.name, config)
    return time.perf_counter() - started


def jacobi_forcing(stage: Stage, out: Path, config: DemoConfig, log: Callable[[str], None] = print) -> None:
    """Run the stage's Jacobi Forcing round (`fastforward jacobi-forcing` with the settings its
    provenance records); its final model becomes out/<name>."""
    o = stage.options
    recorded = ("min_ops", "max_ops", "max_number", "max_factor")
    options = {key: value for key, value in config.task().describe().items() if key in recorded}
    final = progressive_rounds(
        str(out / stage.base),
        out / f"{stage.name}-rounds",
        task_prompts("arithmetic", o["prompts"], "train", options=options),
        [Round(block_size=o["block_size"], noise_window=o["block_size"])],
        JacobiForcing("random", o["block_size"], "clean", ar_weight=1.0, block_size=o["block_size"]),
        TrainConfig(
            steps=stage.steps,
            seq_len=320,
            batch_size=o["batch_size"],
            lr=stage.lr,
            warmup=20,
            seed=config.seed,
            eval_every=0,
            save_every=max(1, stage.steps // 4),
            keep_checkpoints=1,
        ),
        Collection(max_new_tokens=config.max_new_tokens, batch_size=16, seed=config.seed, chat_template=False),
        dtype="float32",
        only_correct=True,
        log=log,
    )
    shutil.rmtree(out / stage.name, ignore_errors=True)
    shutil.copytree(final, out / stage.name, ignore=shutil.ignore_patterns("checkpoints", "*.lock"))


def train_zoo(out: str | Path, config: DemoConfig | None = None, log: Callable[[str], None] = print) -> dict:
    """Every stage of the recipe, in order, into `out`; returns seconds per stage."""
    out = Path(out)
    seconds = {}
    for stage in RECIPE:
        seconds[stage.name] = train_stage(stage, out, config, log)
        write_provenance(out / stage.name, stage, seconds[stage.name], "fastforward demo --retrain")
    return seconds


def write_task_options(directory: Path, config: DemoConfig) -> None:
    task = config.task().describe()
    (directory / TASK_FILE).write_text(json.dumps(task, indent=2) + "\n")


def task_options(directory: str | Path, task: str) -> dict[str, Any]:
    """The options of `task` that the checkpoint in `directory` was trained for ({} if none recorded);
    a task built on the recorded one (`arithmetic-infill`, `arithmetic-number-infill`) shares them."""
    path = Path(directory) / TASK_FILE
    if not path.is_file():
        return {}
    recorded = json.loads(path.read_text())
    if task != recorded.get("name") and not task.startswith(f"{recorded.get('name')}-"):
        return {}
    return {k: v for k, v in recorded.items() if k not in ("name", "themes", "test_fraction", "strict")}


def final_losses(run: Path, last: int = 50) -> dict[str, float]:
    """Mean of each loss term over the last `last` training steps of a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split") == "train"][-last:]
    keys = [k for k in train[-1] if k.endswith("loss")] if train else []
    return {k: round(sum(r[k] for r in train) / len(train), 4) for k in keys}


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_provenance(run: Path, stage: Stage, seconds: float, command: str, commit: str | None = None, **notes) -> Path:
    """provenance.json of a trained stage (weights hashed as they are in `run`)."""
    weights = run / "model.safetensors"
    record = {
        "description": stage.description,
        "stage": asdict(stage),
        "command": command,
        "commit": commit or git_commit(),
        "seconds": round(seconds, 1),
        "machine": {"platform": platform.platform(), "processor": cpu_model(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "final_losses": final_losses(run),
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        **notes,
    }
    path = run / "provenance.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def pack(run: str | Path, dest: str | Path) -> Path:
    """Write a trained stage as a shipped checkpoint: bf16 weights, tokenizer, task options,
    provenance (its sha256 then names the shipped weights; the training run's is kept beside it)."""
    run, dest = Path(run), Path(dest)
    provenance = json.loads((run / "provenance.json").read_text())
    model = load_model(str(run), dtype="bfloat16")
    model.save(dest)
    (dest / TASK_FILE).write_text((run / TASK_FILE).read_text())
    weights = hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest()
    provenance.update({"trained_sha256": provenance["sha256"], "sha256": weights, "stored_as": "bfloat16"})
    (dest / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return dest


def verify(directory: str | Path) -> dict[str, Any]:
    """A shipped checkpoint's provenance, after checking its weights against the recorded sha256."""
    directory = Path(directory)
    record = json.loads((directory / "provenance.json").read_text())
    actual = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    if actual != record["sha256"]:
        raise FastForwardError(
            f"{directory}/model.safetensors does not match its provenance (sha256 {actual[:12]}…, recorded "
            f"{record['sha256'][:12]}…); restore it from git or retrain with `fastforward demo --retrain`"
        )
    return record
