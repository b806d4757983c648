"""`fastforward recipe jacobi-forcing`: a model made fast on the user's own prompts, from one command.

Stages, each kept in the work folder and skipped once done (rerun the same command to resume; an
unfinished training run continues from its last checkpoint):

1. data: the records split once into train and a dev split of `dev` records that nothing trains on
   (WORK/train.jsonl, WORK/dev.jsonl), and the plan: the budget's tokens shared between the stages
   (WORK/plan.json);
2. sft (when the records carry completions): an `ntp` LoRA adapter on them, the domain-tuned start
   that CLLM's targets had (WORK/sft);
3. targets: what Jacobi Forcing trains toward, the start model's own greedy answers (`self`,
   WORK/answers.jsonl) or the records' completions (`reference`) (`fastforward.recipes.targets`);
4. jf: `jacobi_forcing` with random-tail states (no rollouts) as a second LoRA adapter over the start,
   snapshots along the way (WORK/jf, WORK/curve/step-N);
5. control (`control`): the start trained on with `ntp` for as many steps, on the records' completions
   (WORK/control);
6. dev: on the dev split, at the precision `generate` runs (int4 `--exact`), batch 1, greedy: each curve
   point's AR accuracy and `jacobi` TPF, then `ar`, `lookup` and `jacobi` at each of `blocks` of the
   final model, interleaved, and the base's and the control's `ar`; the fastest lossless one becomes the
   model's decoding defaults (WORK/dev.json);
7. ship: both adapters flattened into one bfloat16 adapter over the base, with its `decoding.json`
   (WORK/shipped); `ship_to` copies it with a `provenance.json` that names the command that rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastforward.cpu.threads import cpu_model
from fastforward.decoding.model_defaults import DecodingDefaults, write_decoding_defaults
from fastforward.errors import FastForwardError
from fastforward.model import Model, adapters, load_model
from fastforward.model.flatten import flatten
from fastforward.recipes import dev_eval
from fastforward.recipes.records import Record, parse_budget, read_records, split_dev, write_records
from fastforward.recipes.targets import TARGETS, reference_examples, self_answers
from fastforward.training.data import Example, PackedData
from fastforward.training.objectives import JacobiForcing, make_objective
from fastforward.training.run_dir import finished_run, model_identity, save_adapter_snapshot, tokens_seen
from fastforward.training.trainer import TrainConfig, default_autocast, train
from fastforward.training.trajectories import TrajectoryData, from_examples

SERVED = {"quantize": "int4", "exact": True}  # the precision `fastforward generate` runs a model at on a CPU


@dataclass(frozen=True)
class RecipeOptions:
    """What the recipe's command line sets; the fields that shape training are recorded in WORK/plan.json
    and a rerun in the same work folder must keep them."""

    model: str = "smollm2-135m"
    budget: str = "1h"
    dev: int = 100
    seed: int = 0
    sft: bool = True
    sft_share: float = 0.25
    targets: str = "self"
    answers: int = 0
    block_size: int = 16
    blocks: tuple[int, ...] = (8, 12, 16)
    ar_weight: float = 10.0
    noise_schedule: str = "random"
    lora_rank: int = 16
    lr: float = 1e-3
    seq_len: int = 512
    batch_size: int = 8
    curve: int = 4
    curve_n: int = 30
    control: bool = False
    max_new_tokens: int = 256
    command: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.targets not in TARGETS:
            raise FastForwardError(f"--targets {self.targets!r}: choose one of {', '.join(TARGETS)}")
        if not 0 < self.sft_share < 1:
            raise FastForwardError(f"--sft-share must be between 0 and 1, got {self.sft_share}")
        if self.answers < 0:
            raise FastForwardError(f"--answers must be 0 (as many as one epoch needs) or more, got {self.answers}")
        for name in ("dev", "block_size", "lora_rank", "seq_len", "batch_size", "curve", "curve_n", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise FastForwardError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.blocks or min(self.blocks) < 1:
            raise FastForwardError(f"--blocks must be block sizes of at least 1, got {list(self.blocks)}")
        parse_budget(self.budget)


# What a rerun must share with the run it resumes (the rest only changes the evaluation).
TRAINING_FIELDS = (
    "model", "budget", "dev", "seed", "sft", "sft_share", "targets", "answers", "block_size", "ar_weight",
    "noise_schedule", "lora_rank", "lr", "seq_len", "batch_size", "curve", "control",
)  # fmt: skip


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Recipe:
    """One recipe run in one work folder; `run()` does every stage not yet done."""

    def __init__(self, data: Path, work: Path, options: RecipeOptions, log: Callable[[str], None] = print):
        self.data, self.work, self.options, self.log = Path(data), Path(work), options, log
        self.work.mkdir(parents=True, exist_ok=True)
        self.plan = self._plan()
        self.train_records = read_records(self.work / "train.jsonl")
        self.dev_records = read_records(self.work / "dev.jsonl")

    # ---- stage 1: data and plan ---------------------------------------------------------------------
    def _plan(self) -> dict[str, Any]:
        path = self.work / "plan.json"
        wanted = {name: getattr(self.options, name) for name in TRAINING_FIELDS}
        data_sha = _sha256(self.data)
        if path.exists():
            plan = json.loads(path.read_text())
            changed = [k for k, v in wanted.items() if plan["options"].get(k) != v]
            if plan["data_sha256"] != data_sha:
                changed.append("--data (its contents)")
            if changed:
                raise FastForwardError(
                    f"{self.work} holds a recipe run with other settings ({', '.join(changed)}); rerun with the "
                    "same ones to resume it, or give a new --work"
                )
            return plan
        records = read_records(self.data)
        train, dev = split_dev(records, self.options.dev, self.options.seed)
        write_records(self.work / "train.jsonl", train)
        write_records(self.work / "dev.jsonl", dev)
        budget = parse_budget(self.options.budget)
        completions = all(r.completion is not None for r in train)
        if self.options.control and not completions:
            raise FastForwardError("--control trains on the records' completions: every record needs one")
        sft = self.options.sft and completions
        sft_tokens = int(budget * self.options.sft_share) if sft else 0
        row = self.options.batch_size * self.options.seq_len
        plan = {
            "options": wanted,
            "data": self.data.name,
            "data_sha256": data_sha,
            "records": {"train": len(train), "dev": len(dev)},
            "budget_tokens": budget,
            "sft_steps": max(1, sft_tokens // row) if sft else 0,
            "mixed_precision": default_autocast(),
            "jf_tokens": budget - sft_tokens,
        }
        _write_json(path, plan)
        self.log(
            f"plan: {budget:,} training tokens; {len(train)} train and {len(dev)} dev records; "
            f"SFT {plan['sft_steps']} steps of {self.options.batch_size} rows of {self.options.seq_len}"
        )
        return plan

    def _save_plan(self, **values: Any) -> None:
        self.plan.update(values)
        _write_json(self.work / "plan.json", self.plan)

    # ---- training stages ----------------------------------------------------------------------------
    def _config(self, steps: int) -> TrainConfig:
        o = self.options
        return TrainConfig(
            steps=steps, seq_len=o.seq_len, batch_size=o.batch_size, lr=o.lr, warmup=min(10, max(steps // 10, 1)),
            mixed_precision=self.plan["mixed_precision"], save_every=25, eval_every=0, keep_checkpoints=1,
            lora_rank=o.lora_rank, seed=o.seed,
        )  # fmt: skip

    def _ntp(self, start: str, records: list[Record], run: Path, steps: int) -> None:
        if finished_run(run):
            return
        model = load_model(start)
        examples = reference_examples(records, model)
        rows = PackedData(examples, self.options.seq_len, model.pad_token_id)
        self.log(f"ntp from {start}: {steps} steps → {run}")
        train(model, make_objective("ntp"), rows, self._config(steps), run)

    @property
    def start(self) -> str:
        """The model Jacobi Forcing starts from: the SFT adapter, or the base without an SFT stage."""
        return str(self.work / "sft") if self.plan["sft_steps"] else self.options.model

    def _targets(self, model: Model) -> list[Example]:
        if self.options.targets == "reference":
            return reference_examples(self.train_records, model)
        wanted = self.plan.get("answers")
        if wanted is None:  # --answers, or enough for one epoch of the JF stage's tokens (a row: about 0.6 seq_len)
            epoch = math.ceil(self.plan["jf_tokens"] / (0.6 * self.options.seq_len))
            wanted = min(len(self.train_records), self.options.answers or max(self.options.batch_size, epoch))
            self._save_plan(answers=wanted)
        self.log(f"targets: the start model's own greedy answers to {wanted} train prompts (int4 --exact)")
        served = lambda: load_model(self.start, **SERVED)  # noqa: E731 (loaded only when answers are missing)
        answers = self.work / "answers.jsonl"
        return self_answers(served, self.train_records[:wanted], answers, self.options.max_new_tokens)

    def _jacobi_forcing(self) -> list[int]:
        """Train (or resume) Jacobi Forcing, keeping the curve's snapshots; returns the curve's steps."""
        run, o = self.work / "jf", self.options
        model = load_model(self.start)
        trajectories = from_examples(self._targets(model), o.block_size, model.pad_token_id)
        rows = TrajectoryData(trajectories, o.seq_len)
        if "jf_steps" not in self.plan:
            per_row = sum(len(t.prompt_ids) + 2 * o.block_size * len(t.blocks) for t in rows.examples) / len(rows)
            self._save_plan(jf_steps=max(1, round(self.plan["jf_tokens"] / (per_row * o.batch_size))))
        steps = self.plan["jf_steps"]
        points = sorted({max(1, round(steps * (i + 1) / o.curve)) for i in range(o.curve)})
        if finished_run(run):
            return points
        objective = JacobiForcing(
            noise_schedule=o.noise_schedule, noise_window=o.block_size, ar_weight=o.ar_weight,
            states="random-tail", block_size=o.block_size,
        )  # fmt: skip
        provenance = {"base": model_identity(self.start), "objective": objective.describe()}

        def snapshot(step: int, _: dict) -> None:
            if step in points and step < steps:
                save_adapter_snapshot(model, self.work / "curve" / f"step-{step:05d}", {**provenance, "step": step})

        (self.work / "curve").mkdir(exist_ok=True)
        self.log(f"jacobi_forcing from {self.start}: {steps} steps of {o.batch_size} rows → {run}")
        train(model, objective, rows, self._config(steps), run, callback=snapshot)
        return points

    def _jf_model(self, step: int) -> str:
        if step == 0:
            return self.start
        return str(self.work / "jf") if step == self.plan["jf_steps"] else str(self.work / "curve" / f"step-{step:05d}")

    # ---- stage 6: the dev split ---------------------------------------------------------------------
    def _dev(self, points: list[int]) -> dict[str, Any]:
        path, o = self.work / "dev.json", self.options
        record = json.loads(path.read_text()) if path.exists() else {}
        records = self.dev_records
        base = load_model(o.model, **SERVED)
        prompts = [base.encode_prompt(r.prompt) for r in records]
        few, few_prompts = records[: o.curve_n], prompts[: o.curve_n]

        def keep(name: str, value: Any) -> None:
            record[name] = value
            _write_json(path, record)
            self.log(f"dev {name}: {json.dumps(value)}")

        seen = tokens_seen(self.work / "jf")
        for step in [0, *points]:
            if any(p["step"] == step for p in record.get("curve", [])):
                continue
            model = load_model(self._jf_model(step), **SERVED)
            contenders = {"ar": (model, "ar", {}), "jacobi": (model, "jacobi", {"block_size": o.block_size})}
            rows = dev_eval.table(contenders, few, few_prompts, o.max_new_tokens)
            point = {"step": step, "tokens": seen.get(step, 0.0), **rows}
            record["curve"] = sorted([*record.get("curve", []), point], key=lambda p: p["step"])
            _write_json(path, record)
            self.log(f"dev curve point: {json.dumps(point)}")
        shipped = self._flattened()
        if "final" not in record:
            model = load_model(str(shipped), **SERVED)
            contenders = {"ar": (model, "ar", {}), "lookup": (model, "lookup", {})}
            contenders |= {f"jacobi-{b}": (model, "jacobi", {"block_size": b}) for b in o.blocks}
            rows = dev_eval.table(contenders, records, prompts, o.max_new_tokens)
            keep("final", rows)
            decoders = {label: (name, options) for label, (_, name, options) in contenders.items()}
            where = f"{len(records)} dev prompts, int4 --exact, batch 1, greedy, interleaved; {cpu_model()}"
            keep("defaults", dev_eval.choose_defaults(rows, decoders, where).as_json())
        if "base" not in record:
            keep("base", dev_eval.table({"ar": (base, "ar", {})}, records, prompts, o.max_new_tokens)["ar"])
        if o.control and "control" not in record and finished_run(self.work / "control"):
            control = load_model(str(self.work / "control"), **SERVED)
            keep("control", dev_eval.table({"ar": (control, "ar", {})}, records, prompts, o.max_new_tokens)["ar"])
        return record

    # ---- stage 7: ship ------------------------------------------------------------------------------
    def _flattened(self) -> Path:
        """The adapters from the base to the JF model flattened into one bfloat16 adapter (WORK/shipped)."""
        shipped = self.work / "shipped"
        if not (shipped / adapters.ADAPTER_CONFIG).exists():
            chain = [self.work / "sft", self.work / "jf"] if self.plan["sft_steps"] else [self.work / "jf"]
            flatten(chain, shipped, self.options.model)
        return shipped

    def ship(self, dest: Path, record: dict[str, Any]) -> None:
        """The shipped adapter, its decoding defaults and its provenance, written beside `dest` and renamed."""
        o = self.options
        provenance = {
            "name": dest.name,
            "base": o.model,
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "command": o.command,
            "data": {"file": self.data.name, "sha256": self.plan["data_sha256"], **self.plan["records"]},
            "plan": {k: v for k, v in self.plan.items() if k not in ("data", "data_sha256", "records")},
            "dev": record,
        }
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self._flattened(), tmp)
        write_decoding_defaults(tmp, DecodingDefaults(**record["defaults"]))
        _write_json(tmp / "provenance.json", provenance)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        self.log(f"shipped {dest}")

    def run(self, ship_to: Path | None = None, evaluate: bool = True) -> dict[str, Any] | None:
        """Every stage not yet done; the dev record (None with `evaluate` off)."""
        if self.plan["sft_steps"]:
            self._ntp(self.options.model, self.train_records, self.work / "sft", self.plan["sft_steps"])
        points = self._jacobi_forcing()
        if self.options.control:
            self._ntp(self.start, self.train_records, self.work / "control", self.plan["jf_steps"])
        if not evaluate:
            return None
        record = self._dev(points)
        write_decoding_defaults(self._flattened(), DecodingDefaults(**record["defaults"]))
        if ship_to is not None:
            self.ship(ship_to, record)
        return record


def command_line(options: RecipeOptions, data: Path, work: Path, ship_to: Path | None = None) -> str:
    """The command that runs the recipe with these options, every option that shapes training spelled out
    (what a provenance.json gives to rebuild a model from a fresh work folder)."""
    words = ["fastforward", "recipe", "jacobi-forcing", "--data", str(data), "--work", str(work)]
    for name in TRAINING_FIELDS:
        value, flag = getattr(options, name), "--" + name.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is False:
            words.append("--no-sft" if name == "sft" else "")
        else:
            words += [flag, str(value)]
    words += ["--blocks", *map(str, options.blocks)]
    if ship_to is not None:
        words += ["--ship-to", str(ship_to)]
    return shlex.join(w for w in words if w)
