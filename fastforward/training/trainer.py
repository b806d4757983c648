"""One trainer for every objective, on `accelerate`: one process (CPU or GPU), or a group of N processes
launched by `torchrun --nproc_per_node N` or `accelerate launch --multi_gpu --num_processes N` (DDP over
NCCL on GPUs, gloo on CPUs; FSDP through an accelerate config).

Its run directory (`run_dir`) holds the run's record, metrics, checkpoints and final model.

Resuming is exact: the rows of a step are a function of (seed, step), every random draw a function
of (seed, step, row), and a checkpoint holds the rest of the state. How a step's rows are split across
processes and micro-batches changes neither the draws nor the loss (each term is divided by its token
count over the whole step), so N processes × batch B/N train the model 1 process × batch B does, up to
float summation order, and a run may resume with another split of the same rows per step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, parse_flag_from_env
from torch import nn
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from fastforward.errors import FastForwardError
from fastforward.model import Model, adapters
from fastforward.training import lora, run_dir
from fastforward.training.data import derive_seed
from fastforward.training.launch import launched_processes
from fastforward.training.objectives import Objective

Callback = Callable[[int, dict], None]


class TrainData(Protocol):
    """What the trainer needs of a data set (e.g. PackedData); its batches have `.to(device)` and `.n_tokens`."""

    seq_len: int

    def batch(self, index: int, batch_size: int, seed: int) -> Any:
        """The `index`-th batch: a pure function of (seed, index), so a resume needs only the step."""
        ...

    def in_order(self, batch_size: int) -> Iterator[Any]:
        """Every example once, in a fixed order (evaluation)."""
        ...

    def fingerprint(self) -> str:
        """Changes whenever the data would: a resumed run must see the same data."""
        ...


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. batch_size is per device; one step = grad_accum batches."""

    steps: int = 500
    seq_len: int = 512
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 5e-5
    warmup: int = 20
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    mixed_precision: str = "no"  # "no", "bf16" or "fp16" autocast; weights stay in their dtype
    eval_every: int = 100  # 0: evaluate only at the end
    save_every: int = 100  # 0: no intermediate checkpoints
    keep_checkpoints: int = 2
    max_eval_batches: int = 50
    lora_rank: int = 0  # 0: train every weight; R: a PEFT LoRA adapter of rank R, saved as an adapter directory
    lora_alpha: float = 0.0  # LoRA's scale numerator; 0: twice the rank
    lora_targets: str = adapters.DEFAULT_TARGETS  # "all-linear" or comma-separated module names
    # LoRA layers on the top N decoder layers only (0: every layer): the backward pass stops at the lowest one
    lora_layers: int = 0
    # An adapter directory whose LoRA weights the run starts from (its rank and targets; a fresh optimizer and
    # schedule): training a finished adapter further, on the base it was trained on.
    lora_from: str = ""

    def validate(self) -> None:
        positive = ("steps", "seq_len", "batch_size", "grad_accum", "keep_checkpoints", "max_eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise FastForwardError(f"{name} must be at least 1, got {getattr(self, name)}")
        nonnegative = ("warmup", "weight_decay", "max_grad_norm", "eval_every", "save_every")
        for name in (*nonnegative, "lora_rank", "lora_alpha", "lora_layers"):
            if getattr(self, name) < 0:
                raise FastForwardError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise FastForwardError(f"lr must be > 0, got {self.lr}")
        if self.lora_from and not self.lora_rank:
            raise FastForwardError(f"lora_from {self.lora_from} continues a LoRA adapter: give its lora_rank too")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise FastForwardError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}")

    def evaluates_after(self, step: int) -> bool:
        """Every `eval_every` steps (0: never) and after the last."""
        return bool(self.eval_every and step % self.eval_every == 0) or step == self.steps

    def checkpoints_after(self, step: int) -> bool:
        """Every `save_every` steps (0: never) but the last, which the final save follows."""
        return bool(self.save_every and step % self.save_every == 0) and step < self.steps


def default_autocast() -> str:
    """The `mixed_precision` that pays here: "bf16" where the hardware does bfloat16 arithmetic (a CUDA GPU, a
    CPU with AVX-512 BF16 or AMX), else "no" (a CPU without them emulates it: on a 2-core AVX2 EPYC, a LoRA
    step of SmolLM2-135M on 8 rows of 512 tokens took 96 s in float32 and had not ended after 8 min in bf16)."""
    from fastforward.cpu.quantize import native_bfloat16

    return "bf16" if torch.cuda.is_available() or native_bfloat16() else "no"


class _ObjectiveModule(nn.Module):
    """Runs the objective inside forward(), so DDP/FSDP wrappers and autocast cover all of it."""

    def __init__(self, model: Model, objective: Objective):
        super().__init__()
        self.hf = model.hf
        self.model = model
        self.objective = objective

    def forward(
        self, batch: Any, generator: torch.Generator, norms: dict[str, float] | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return self.objective.loss(self.model, batch, generator, norms)

    def counts(self, batch: Any, generator: torch.Generator) -> dict[str, int]:
        return self.objective.counts(self.model, batch, generator)


# ---- the process group --------------------------------------------------------------------------
LAUNCH_HELP = (
    "launch N processes with `torchrun --nproc_per_node N -m fastforward train ...` or "
    "`accelerate launch --multi_gpu --num_processes N -m fastforward train ...` (without --cpu; on a "
    "machine without GPUs the processes form a CPU group)"
)


def _accelerator(mixed_precision: str) -> Accelerator:
    """This process's accelerate state: one group over every process of a torchrun or accelerate launch.

    accelerate forms a CPU (gloo) group only when told to run on the CPU, so a launch of several
    processes on a machine without a GPU says so; a launch asked for several processes that would
    train alone fails instead (accelerate's launcher without --multi_gpu starts a single process).
    """
    launched = launched_processes()
    if launched <= 1:  # a process training alone: an earlier run in it (another precision) must not pin the state
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    cpu = launched > 1 and (device is None or device.type == "mps")  # MPS forms no group of its own either
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu)
    if accelerator.num_processes == 1 and launched > 1:
        raise FastForwardError(
            f"this process was launched as one of {launched} (WORLD_SIZE) but joined no process group, so it "
            f"would train alone; {LAUNCH_HELP}"
        )
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and accelerator.distributed_type != DistributedType.FSDP:
        raise FastForwardError(
            "FSDP was asked for (accelerate launch --use_fsdp) but accelerate shards models only on GPUs: here "
            f"every process would hold the whole model ({accelerator.distributed_type.value}); launch without "
            "--use_fsdp, or on GPUs"
        )
    if accelerator.num_processes == 1 and "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ:
        raise FastForwardError(
            "`accelerate launch` was asked for several processes but started one (its launcher for --cpu, and "
            f"for machines without GPUs unless --multi_gpu is given, starts a single process); {LAUNCH_HELP}. "
            "To train in one process, run `fastforward train` (or unset MASTER_ADDR)"
        )
    return accelerator


# ---- steps --------------------------------------------------------------------------------------
def _mean_over_processes(accelerator: Accelerator, metrics: dict[str, float]) -> dict[str, float]:
    if accelerator.num_processes == 1:
        return metrics
    values = accelerator.reduce(torch.tensor(list(metrics.values()), device=accelerator.device), "mean")
    return dict(zip(metrics, values.tolist(), strict=True))


def _norms(accelerator: Accelerator, counts: list[dict[str, int]]) -> dict[str, float]:
    """Each loss term's denominator: its token count over the whole step (every micro-batch of every
    process) shared out over those micro-batches, whose gradients DDP and the accumulation average."""
    keys = sorted(counts[0])
    totals = [float(sum(c[k] for c in counts)) for k in keys]
    if accelerator.num_processes > 1:
        summed = accelerator.reduce(torch.tensor(totals, dtype=torch.float64, device=accelerator.device), "sum")
        totals = summed.tolist()
    shares = accelerator.num_processes * len(counts)
    return {k: max(total, 1.0) / shares for k, total in zip(keys, totals, strict=True)}


@dataclass
class _Run:
    """What the steps of one run share: the process group, the prepared module, optimizer and schedule,
    and the checkpoints known to be intact (those a new checkpoint may prune)."""

    accelerator: Accelerator
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: TrainConfig
    out: Path
    objective: str
    intact: list[int] = field(default_factory=list)


def _train_step(run: _Run, data: TrainData, step: int) -> dict:
    """One optimizer step over grad_accum micro-batches of every process; returns metrics averaged over them,
    and the tokens it trained per second.

    The step's rows are the data stream's rows step·R … (step+1)·R − 1 (R rows per step), process p's
    micro-batch m the B of them from (m·N + p)·B on. Every draw comes from the step's generator and each
    row's own stream, and the loss terms are divided by their counts over the whole step (`_norms`,
    counted before the first backward pass), so the update does not depend on how the rows are split.
    """
    started = time.perf_counter()
    accelerator, module, config = run.accelerator, run.module, run.config
    processes, micro_batches = accelerator.num_processes, config.grad_accum
    indices = [(step * micro_batches + micro) * processes + accelerator.process_index for micro in range(micro_batches)]
    batches = [data.batch(i, config.batch_size, config.seed).to(accelerator.device) for i in indices]
    seed = derive_seed(config.seed, "step", step)
    unwrapped = accelerator.unwrap_model(module)
    norms = _norms(accelerator, [unwrapped.counts(b, torch.Generator().manual_seed(seed)) for b in batches])
    totals: dict[str, float] = {}
    for micro, batch in enumerate(batches):
        last = micro == micro_batches - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(module):
            loss, metrics = module(batch, torch.Generator().manual_seed(seed), norms)
            accelerator.backward(loss / micro_batches)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value / micro_batches
    if config.max_grad_norm > 0:
        totals["grad_norm"] = float(accelerator.clip_grad_norm_(module.parameters(), config.max_grad_norm))
    totals["lr"] = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    read = unwrapped.objective.copies * sum(b.n_tokens for b in batches)  # tokens the model read
    metrics = _mean_over_processes(accelerator, {**totals, "tokens": float(read)})
    metrics["tokens"] *= processes  # the mean over processes times their number: the step's tokens
    metrics["tokens_per_s"] = metrics["tokens"] / (time.perf_counter() - started)
    return metrics


@torch.no_grad()
def evaluate(accelerator: Accelerator, module: nn.Module, data: TrainData, config: TrainConfig) -> dict[str, float]:
    """The objective's metrics averaged over the eval rows (same masks and block sizes every time)."""
    module.eval()
    totals: dict[str, float] = {}
    count = 0
    for i, batch in enumerate(data.in_order(config.batch_size)):
        if i >= config.max_eval_batches:
            break
        if i % accelerator.num_processes != accelerator.process_index:
            continue
        generator = torch.Generator().manual_seed(derive_seed(config.seed, "eval", i))
        _, metrics = module(batch.to(accelerator.device), generator)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value
        count += 1
    module.train()
    keys = sorted(totals)
    sums = torch.tensor([totals[k] for k in keys] + [count], dtype=torch.float64, device=accelerator.device)
    sums = accelerator.reduce(sums, "sum") if accelerator.num_processes > 1 else sums
    return {f"eval_{k}": float(v / sums[-1]) for k, v in zip(keys, sums[:-1], strict=True)}


# ---- the trainer --------------------------------------------------------------------------------
def train(
    model: Model,
    objective: Objective,
    train_data: TrainData,
    config: TrainConfig,
    out_dir: str | Path,
    eval_data: TrainData | None = None,
    callback: Callback | None = None,
    overwrite: bool = False,
) -> list[dict]:
    """Train `model` in place with `objective`; resume from `out_dir` if it holds an unfinished run.

    callback(step, record) runs after every step (after that step's checkpoint and evaluation).
    Returns the records logged by this call. Calls in one (unlaunched) process each get a fresh
    accelerate state, so they may differ in mixed_precision.
    """
    config.validate()
    if train_data.seq_len != config.seq_len:
        raise FastForwardError(f"the data was packed into rows of {train_data.seq_len} tokens, not {config.seq_len}")
    if model.max_context and config.seq_len > model.max_context:
        raise FastForwardError(f"seq_len {config.seq_len} exceeds the model's context of {model.max_context} tokens")
    out = Path(out_dir)
    accelerator = _accelerator(config.mixed_precision)
    if model.uses_flex and accelerator.device.type != "cuda":
        raise FastForwardError(
            f"FlexAttention trains only on CUDA GPUs (torch has no backward for it on {accelerator.device.type}); "
            "train with --attention sdpa"
        )
    objective.setup(model)
    lora_options = (config.lora_rank, config.lora_alpha, config.lora_targets, config.seed, config.lora_from)
    with lora.layers(model, *lora_options, top_layers=config.lora_layers):
        return _train(model, objective, train_data, config, out, accelerator, eval_data, callback, overwrite)


def _train(
    model: Model,
    objective: Objective,
    train_data: TrainData,
    config: TrainConfig,
    out: Path,
    accelerator: Accelerator,
    eval_data: TrainData | None,
    callback: Callback | None,
    overwrite: bool,
) -> list[dict]:
    """`train` once the model is ready (with its LoRA layers, in a LoRA run): the run directory, the loop,
    the final save."""
    record = _run_record(model, objective, train_data, config, accelerator)
    with run_dir.claim(accelerator, out, record, overwrite) as checkpoint:
        run = _prepare(model, objective, config, out, accelerator)
        history = _loop(run, train_data, eval_data, _resume(run, checkpoint), callback)
        run_dir.save_final(accelerator, run.module, model, out, _provenance(record, config))
        accelerator.wait_for_everyone()
        _hand_back(model, config)
        return history


def _provenance(record: dict, config: TrainConfig) -> dict:
    """What an adapter records of its training (fastforward_adapter.json): its base, which loading follows
    to the model under it (so a local one stays a path, made path-free when a chain is flattened to ship:
    `fastforward.model.flatten`), the objective and the settings, `lora_from` by its folder's name only."""
    train = {**record["train"], "lora_from": adapters.training_folder(config.lora_from) if config.lora_from else ""}
    return {"base": record["model"]["name"], "objective": record["objective"], "train": train}


def _run_record(
    model: Model, objective: Objective, data: TrainData, config: TrainConfig, accelerator: Accelerator
) -> dict:
    """What the run directory records of a run: what a resumed run must share with the run it continues."""
    return {
        "train": asdict(config),
        "rows_per_step": config.batch_size * config.grad_accum * accelerator.num_processes,
        "objective": objective.describe(),
        "model": {
            "name": run_dir.model_identity(model.name),
            "parameters": sum(p.numel() for p in model.hf.parameters()),
        },
        "data": data.fingerprint(),
    }


def _prepare(model: Model, objective: Objective, config: TrainConfig, out: Path, accelerator: Accelerator) -> _Run:
    """The model in training mode, its optimizer and schedule, wrapped for the process group; the schedule
    is saved with every checkpoint."""
    model.hf.train()
    optimizer = _optimizer(model, config)
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup, config.steps)
    module, optimizer = accelerator.prepare(_ObjectiveModule(model, objective), optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return _Run(accelerator, module, optimizer, scheduler, config, out, objective.name)


def _optimizer(model: Model, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trained weights (a LoRA run's adapter weights only), without decay on biases and norms."""
    trained = [p for p in model.hf.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    rest = [p for p in trained if p.ndim < 2]
    # fused: one kernel over every tensor rather than a pass per operation (where torch has it: floating
    # point on CPU and CUDA); the optimizer step is memory-bound, so the passes are its cost
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in trained)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=config.lr,
        fused=fused or None,
    )


def _resume(run: _Run, checkpoint: Path | None) -> int:
    """The step the run starts from: 0, or its checkpoint's (loaded), with the metrics logged after it dropped."""
    step = 0
    if checkpoint is not None:
        step = run_dir.load_checkpoint(run.accelerator, checkpoint)
        run.intact.append(step)
    if run.accelerator.is_main_process:
        run_dir.truncate_metrics(run.out / run_dir.METRICS, step)
        if step:
            tqdm.write(f"resuming {run.out} from step {step}")
    return step


def _loop(
    run: _Run, train_data: TrainData, eval_data: TrainData | None, step: int, callback: Callback | None
) -> list[dict]:
    """The steps after `step`, each logged, then evaluated and checkpointed when due; returns the records."""
    config, main = run.config, run.accelerator.is_main_process
    history: list[dict] = []
    bar = tqdm(
        total=config.steps,
        initial=step,
        desc=f"train {run.objective}",
        disable=None if main else True,
        dynamic_ncols=True,
    )
    while step < config.steps:
        metrics = _train_step(run, train_data, step)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        entries = [{"step": step, "split": "train", **metrics}]
        if eval_data is not None and config.evaluates_after(step):
            entries.append(_evaluation(run, eval_data, step))
        if main:
            run_dir.append_metrics(run.out, entries)
        if config.checkpoints_after(step):
            _save_checkpoint(run, step)
        history.extend(entries)
        if callback is not None:
            callback(step, {k: v for e in entries for k, v in e.items() if k != "split"})
    bar.close()
    return history


def _evaluation(run: _Run, data: TrainData, step: int) -> dict:
    """The eval record after step `step`, also written to the terminal."""
    scores = evaluate(run.accelerator, run.module, data, run.config)
    if run.accelerator.is_main_process:
        tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
    return {"step": step, "split": "eval", **scores}


def _save_checkpoint(run: _Run, step: int) -> None:
    """A checkpoint after step `step`, pruning older intact ones down to `keep_checkpoints`."""
    run_dir.save_checkpoint(run.accelerator, run.out, step, run.config.keep_checkpoints, tuple(run.intact))
    run.intact.append(step)


def _hand_back(model: Model, config: TrainConfig) -> None:
    """The trained model as its caller goes on with it: in eval mode, and after a LoRA run a plain model
    with the adapter merged, as the adapter's loaders give it."""
    if config.lora_rank:
        model.hf = model.hf.merge_and_unload()
    model.hf.eval()
