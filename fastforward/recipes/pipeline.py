"""The stages every recipe shares, around the one stage that is its method's own.

Stages, each kept in the work folder and skipped once done (rerun the same command to resume; an
unfinished training run continues from its last checkpoint):

1. data: the records split once into train and a dev split of `dev` records that nothing trains on
   (WORK/train.jsonl, WORK/dev.jsonl), and the plan: the budget's tokens shared between the stages
   (WORK/plan.json);
2. sft (when the records carry completions): an `ntp` LoRA adapter on them, the domain-tuned start
   (WORK/sft);
3. targets: what the method trains toward, the start model's own greedy answers (`self`,
   WORK/answers.jsonl) or the records' completions (`reference`) (`fastforward.recipes.targets`);
4. the method's own training, a second LoRA adapter over the start, with snapshots for the learning
   curve (WORK/<stage>, WORK/curve/step-N);
5. control (`control`): the start trained on with `ntp` for as many steps, on the records' completions
   (WORK/control);
6. dev: on the dev split, at the precision `generate` runs (int4 `--exact`), batch 1, greedy: each curve
   point's AR accuracy and the method's decoder, then the final model's `ar`, `lookup` and the method's
   decoders, interleaved, and the base's and the control's `ar`; the fastest lossless one becomes the
   model's decoding defaults (WORK/dev.json);
7. ship: both adapters flattened into one bfloat16 adapter over the base, with its `decoding.json`
   (WORK/shipped); `ship_to` copies it with a `provenance.json` that names the command that rebuilds it.

A method is a subclass of `Recipe` in its own module, registered with `@register(name)`: its options
(a subclass of `RecipeOptions`), its training stage and its decoders. `fastforward recipe NAME` offers
every registered one, its flags made from its options' fields.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from fastforward.cpu.threads import cpu_model
from fastforward.decoding.decoders import registry
from fastforward.decoding.model_defaults import DecodingDefaults, write_decoding_defaults
from fastforward.errors import FastForwardError
from fastforward.model import Model, adapters, load_model
from fastforward.model.flatten import flatten
from fastforward.recipes import dev_eval
from fastforward.recipes.continued import continuation, start_adapter
from fastforward.recipes.options import Data, Decoders, RecipeOptions, command_line
from fastforward.recipes.records import (
    DataFile,
    Record,
    TaskData,
    parse_budget,
    read_records,
    split_dev,
    write_records,
)
from fastforward.recipes.targets import reference_examples, self_answers
from fastforward.registry import Registry
from fastforward.training.data import Example, PackedData
from fastforward.training.objectives import Objective, make_objective
from fastforward.training.run_dir import (
    finished_run,
    model_identity,
    save_adapter_snapshot,
    tokens_seen,
    write_json_atomic,
)
from fastforward.training.trainer import TrainConfig, TrainData, default_autocast, train

SERVED = {"quantize": "int4", "exact": True}  # the precision `fastforward generate` runs a model at on a CPU


class Recipe:
    """One recipe run in one work folder; `run()` does every stage not yet done. A method's subclass sets
    the class attributes and implements `objective`, `rows`, `curve_decoders` and `final_decoders`."""

    name: ClassVar[str]  # the command: `fastforward recipe NAME`
    summary: ClassVar[str]  # its one-line help
    stage: ClassVar[str]  # the method's training folder and plan keys: WORK/<stage>, <stage>_steps
    method: ClassVar[str]  # what the shipped adapter is, for its description: "a Jacobi Forcing LoRA adapter"
    options_class: ClassVar[type[RecipeOptions]] = RecipeOptions

    def __init__(
        self, data: Data | Path | str | None, work: Path, options: RecipeOptions, log: Callable[[str], None] = print
    ):
        """`data` None: the run already planned in `work`, as it is (`reopen`), to measure what it trained."""
        self.data = data if data is None or isinstance(data, DataFile | TaskData) else DataFile(Path(data))
        self.work, self.options, self.log = Path(work), options, log
        self.work.mkdir(parents=True, exist_ok=True)
        self.plan = self._plan()
        self.train_records = read_records(self.work / "train.jsonl")
        self.dev_records = read_records(self.work / "dev.jsonl")

    # ---- what a method defines ----------------------------------------------------------------------
    def objective(self) -> Objective:
        """The method's training objective."""
        raise NotImplementedError

    def rows(self, examples: list[Example], model: Model) -> TrainData:
        """The method's training rows from the target examples: packed rows of `seq_len`, unless a method
        needs its own shape (Jacobi Forcing's trajectories)."""
        return PackedData(examples, self.options.seq_len, model.pad_token_id)

    def row_tokens(self, rows: TrainData) -> float:
        """Tokens the model reads for a row of `rows` on average (what the budget counts, as the trainer does)."""
        return float(self.options.seq_len * self.objective().copies)

    def curve_decoders(self) -> Decoders:
        """The rows measured at each curve point (`ar` among them)."""
        raise NotImplementedError

    def final_decoders(self) -> Decoders:
        """The rows measured on the whole dev split for the final model (`ar` among them)."""
        raise NotImplementedError

    # ---- stage 1: data and plan ---------------------------------------------------------------------
    def _plan(self) -> dict[str, Any]:
        path = self.work / "plan.json"
        wanted = self.options.training()
        if self.data is None:
            if not path.exists():
                raise FastForwardError(f"{self.work} holds no recipe run (no plan.json): give its --data or --task")
            return json.loads(path.read_text())
        data_sha = self.data.sha256()
        if path.exists():
            plan = json.loads(path.read_text())
            changed = [k for k, v in wanted.items() if plan["options"].get(k) != v]
            if plan.get("recipe", self.name) != self.name:
                changed.append(f"the recipe ({plan['recipe']})")
            if plan["data_sha256"] != data_sha:
                changed.append("--data (its contents)")
            if changed:
                raise FastForwardError(
                    f"{self.work} holds a recipe run with other settings ({', '.join(changed)}); rerun with the "
                    "same ones to resume it, or give a new --work"
                )
            return plan
        records, o = self.data.records(), self.options
        train_records, dev = split_dev(records, o.dev, o.seed)
        completions = all(r.completion is not None for r in train_records)
        if o.control and not completions:
            raise FastForwardError("--control trains on the records' completions: every record needs one")
        write_records(self.work / "train.jsonl", train_records)
        write_records(self.work / "dev.jsonl", dev)
        budget = parse_budget(o.budget)
        start = continuation(o.from_adapter, o.model, self.objective().name) if o.from_adapter else None
        if o.start:  # refused before the work folder holds a plan
            start_adapter(o.start, o.model)
        sft = o.sft and completions and start is None and not o.start  # a continued model holds its start already
        plan = {
            "recipe": self.name,
            "options": wanted,
            "data": self.data.name,
            "data_sha256": data_sha,
            "records": {"train": len(train_records), "dev": len(dev)},
            "mixed_precision": default_autocast(),
            **({"from": start} if start else {}),
        }
        if budget.tokens is not None:  # each stage's steps: its share of the tokens
            sft_tokens = int(budget.tokens * o.sft_share) if sft else 0
            plan["budget_tokens"] = budget.tokens
            plan["sft_steps"] = max(1, round(sft_tokens / (o.batch_size * o.seq_len))) if sft else 0
            plan[f"{self.stage}_tokens"] = budget.tokens - sft_tokens
        else:  # each stage's share of the time, at its own rate (`_size`)
            plan["budget_seconds"] = budget.seconds
            plan["sft_seconds"] = budget.seconds * o.sft_share if sft else 0.0
            plan[f"{self.stage}_seconds"] = budget.seconds - plan["sft_seconds"]
        write_json_atomic(path, plan)
        share = f"{budget.tokens:,} training tokens" if budget.tokens else f"{o.budget} of training"
        self.log(f"plan: {share}; {len(train_records)} train and {len(dev)} dev records; SFT: {'yes' if sft else 'no'}")
        return plan

    def _size(self, key: str, per_step: float, start: str, objective: Objective, rows: TrainData) -> int:
        """The steps of training stage `key` ("sft" or the method's), kept in the plan: its tokens over a step's,
        or, for a budget in time, its seconds at the rate this stage's own steps run at here (three steps of its
        objective on its rows from a fresh copy of its start, the first left out), less the time that took."""
        if f"{key}_steps" in self.plan:
            return self.plan[f"{key}_steps"]
        if f"{key}_seconds" not in self.plan:
            steps = max(1, round(self.plan[f"{key}_tokens"] / per_step))
            self._save_plan(**{f"{key}_steps": steps})
            return steps
        self.log(f"{key}: measuring its training rate here (three steps) to fit {self.plan[f'{key}_seconds']:.0f} s")
        began = time.monotonic()
        model = load_model(start)
        objective.setup(model)
        with tempfile.TemporaryDirectory() as tmp:
            history = train(model, objective, rows, self._stage_config(key, 3), Path(tmp) / "probe")
        rates = [entry["tokens_per_s"] for entry in history if entry["split"] == "train"][1:]
        rate = sum(rates) / len(rates)
        left = max(0.0, self.plan[f"{key}_seconds"] - (time.monotonic() - began))
        steps = max(1, round(left * rate / per_step))
        self._save_plan(**{f"{key}_tokens_per_s": round(rate, 1), f"{key}_steps": steps})
        self.log(f"{key}: {rate:.0f} tokens/s here: {steps} steps ({steps * per_step:,.0f} tokens) in {left:.0f} s")
        return steps

    def _save_plan(self, **values: Any) -> None:
        self.plan.update(values)
        write_json_atomic(self.work / "plan.json", self.plan)

    # ---- training stages ----------------------------------------------------------------------------
    def _config(self, steps: int) -> TrainConfig:
        o = self.options
        micro = o.micro_batch or o.batch_size  # a step's rows in batches of `micro`: the same rows, less memory
        return TrainConfig(
            steps=steps, seq_len=o.seq_len, batch_size=micro, grad_accum=o.batch_size // micro, lr=o.lr,
            warmup=min(10, max(steps // 10, 1)),
            mixed_precision=self.plan["mixed_precision"], save_every=25, eval_every=0,
            keep_checkpoints=1, lora_rank=o.lora_rank, lora_layers=o.lora_layers, seed=o.seed,
        )  # fmt: skip

    def _stage_config(self, key: str, steps: int) -> TrainConfig:
        """Stage `key`'s settings: the method's stage of a continued model trains that model's adapter further."""
        config, continued = self._config(steps), self.plan.get("from")
        if key == self.stage and continued:
            return replace(config, lora_from=continued["adapter"], lora_rank=continued["rank"])
        return config

    def _ntp(self, key: str, start: str, records: list[Record], run: Path, steps: int | None = None) -> None:
        """An `ntp` stage (`key`: SFT or the control) from `start` on the records' completions; `steps` None: as
        many as `_size` gives it."""
        if finished_run(run):
            return
        model = load_model(start)
        rows = PackedData(reference_examples(records, model), self.options.seq_len, model.pad_token_id)
        ntp = make_objective("ntp")
        steps = steps or self._size(key, self.options.batch_size * self.options.seq_len, start, ntp, rows)
        self.log(f"ntp from {start}: {steps} steps → {run}")
        train(model, ntp, rows, self._config(steps), run)

    def start_chain(self) -> list[Path]:
        """The adapters from the base to the model the method starts from: `--start`'s (a shared SFT start, or
        the model of another method that this one post-trains, as MultiTF does SBD's), the SFT stage's, or none."""
        if self.options.start:
            return [start_adapter(self.options.start, self.options.model)]
        return [self.work / "sft"] if self.has_sft else []

    @property
    def has_sft(self) -> bool:
        """Whether the plan has an SFT stage (steps in a token budget, seconds in a time budget)."""
        return bool(self.plan.get("sft_steps") or self.plan.get("sft_seconds"))

    def _chain(self) -> list[Path]:
        """`start_chain`, or none when the run continues a shipped model (`--from`: one adapter over the base)."""
        return [] if "from" in self.plan else self.start_chain()

    @property
    def start(self) -> str:
        """The model the method starts from: the last adapter of `start_chain`, the shipped model `--from`
        continues, or the base."""
        chain = self._chain()
        return str(chain[-1]) if chain else self.plan.get("from", {}).get("adapter", self.options.model)

    @property
    def steps(self) -> int:
        return self.plan[f"{self.stage}_steps"]

    def _targets(self, model: Model) -> list[Example]:
        if self.options.targets == "reference":
            return reference_examples(self.train_records, model)
        wanted = self.plan.get("answers")
        if wanted is None:  # --answers, or enough for one epoch of the method's tokens (a row: about 0.6 seq_len)
            epoch = math.ceil(self.plan[f"{self.stage}_tokens"] / (0.6 * self.options.seq_len))
            wanted = min(len(self.train_records), self.options.answers or max(self.options.batch_size, epoch))
            self._save_plan(answers=wanted)
        self.log(f"targets: the start model's own greedy answers to {wanted} train prompts (int4 --exact)")
        served = lambda: load_model(self.start, **SERVED)  # noqa: E731 (loaded only when answers are missing)
        answers = self.work / "answers.jsonl"
        return self_answers(served, self.train_records[:wanted], answers, self.options.answer_tokens)

    def _train_method(self) -> list[int]:
        """Train (or resume) the method's stage, keeping the curve's snapshots; returns the curve's steps."""
        run, o = self.work / self.stage, self.options
        if finished_run(run):  # its steps are in the plan: nothing to load
            return self._points()
        continued = self.plan.get("from")  # its adapter is trained on, over the base
        model = load_model(o.model if continued else self.start)
        objective = self.objective()
        objective.setup(model)  # e.g. the mask token SBD adds, before the targets are tokenized
        rows = self.rows(self._targets(model), model)
        start, per_step = o.model if continued else self.start, self.row_tokens(rows) * o.batch_size
        self._size(self.stage, per_step, start, objective, rows)
        if "budget_seconds" in self.plan and "budget_tokens" not in self.plan:  # what the time came to
            sft_tokens = self.plan.get("sft_steps", 0) * o.batch_size * o.seq_len
            self._save_plan(budget_tokens=round(sft_tokens + self.plan[f"{self.stage}_steps"] * per_step))
        steps, points = self.steps, self._points()
        provenance = {"base": model_identity(start), "objective": objective.describe()}

        def snapshot(step: int, _: dict) -> None:
            if step in points and step < steps:
                save_adapter_snapshot(model, self.work / "curve" / f"step-{step:05d}", {**provenance, "step": step})

        (self.work / "curve").mkdir(exist_ok=True)
        self.log(f"{objective.name} from {self.start}: {steps} steps of {o.batch_size} rows → {run}")
        train(model, objective, rows, self._stage_config(self.stage, steps), run, callback=snapshot)
        return points

    def _points(self) -> list[int]:
        """The steps of the learning curve's points after step 0 (the last: the finished run)."""
        return sorted({max(1, round(self.steps * (i + 1) / self.options.curve)) for i in range(self.options.curve)})

    def _curve_model(self, step: int) -> str:
        if step == 0:
            return self.start
        return str(self.work / (self.stage if step == self.steps else f"curve/step-{step:05d}"))

    # ---- stage 6: the dev split ---------------------------------------------------------------------
    def _dev(self, points: list[int]) -> dict[str, Any]:
        path, o = self.work / "dev.json", self.options
        record = json.loads(path.read_text()) if path.exists() else {}
        records = self.dev_records[: o.final_n or None]
        base = load_model(o.model, **SERVED)
        prompts = [base.encode_prompt(r.prompt) for r in records]
        few, few_prompts = records[: o.curve_n], prompts[: o.curve_n]

        def keep(name: str, value: Any) -> None:
            record[name] = value
            write_json_atomic(path, record)
            self.log(f"dev {name}: {json.dumps(value)}")

        def measure(model: Model, decoders: Decoders, on: list[Record], encoded: list[list[int]]) -> dict:
            """The rows `model` can run: one without a mask token (the start, before SBD) skips SBD's decoders."""
            runs = {
                k: v
                for k, v in decoders.items()
                if model.mask_token_id is not None or not registry.spec(v[0]).needs_mask
            }
            contenders = {label: (model, name, options) for label, (name, options) in runs.items()}
            return dev_eval.table(contenders, on, encoded, o.max_new_tokens)

        seen = tokens_seen(self.work / self.stage)
        before = self.plan.get("from", {}).get("tokens_before", 0.0)  # a continued model's curve counts on
        for step in [0, *points]:
            if any(p["step"] == step for p in record.get("curve", [])):
                continue
            rows = measure(load_model(self._curve_model(step), **SERVED), self.curve_decoders(), few, few_prompts)
            point = {"step": step, "tokens": before + seen.get(step, 0.0), **rows}
            record["curve"] = sorted([*record.get("curve", []), point], key=lambda p: p["step"])
            write_json_atomic(path, record)
            self.log(f"dev curve point: {json.dumps(point)}")
        if "final" not in record:
            decoders = self.final_decoders()
            rows = measure(load_model(str(self.flattened()), **SERVED), decoders, records, prompts)
            keep("final", rows)
            where = f"{len(records)} dev prompts, int4 --exact, batch 1, greedy, interleaved, {cpu_model()}"
            keep("defaults", dev_eval.choose_defaults(rows, decoders, where).as_json())
        if "base" not in record:
            keep("base", measure(base, {"ar": ("ar", {})}, records, prompts)["ar"])
        if o.control and "control" not in record and finished_run(self.work / "control"):
            control = load_model(str(self.work / "control"), **SERVED)
            keep("control", measure(control, {"ar": ("ar", {})}, records, prompts)["ar"])
        return record

    # ---- stage 7: ship ------------------------------------------------------------------------------
    def flattened(self) -> Path:
        """The adapters from the base to the method's model flattened into one bfloat16 adapter (WORK/shipped)."""
        shipped = self.work / "shipped"
        if not (shipped / adapters.ADAPTER_CONFIG).exists():
            flatten([*self._chain(), self.work / self.stage], shipped, self.options.model)
        return shipped

    def _in_tokens(self) -> RecipeOptions:
        """The options with the budget as the tokens it came to (a budget in time: the SFT share those of its
        steps), so that the shipped command trains the same steps on any machine."""
        o, total = self.options, self.plan["budget_tokens"]
        if "budget_seconds" not in self.plan or not self.plan.get("sft_steps"):
            return replace(o, budget=str(total))
        return replace(
            o, budget=str(total), sft_share=round(self.plan["sft_steps"] * o.batch_size * o.seq_len / total, 6)
        )

    def ship(self, dest: Path, record: dict[str, Any]) -> None:
        """The shipped adapter, its decoding defaults and its provenance, written beside `dest` and renamed."""
        o = self.options
        if self.data is None:
            raise FastForwardError("a reopened recipe run cannot ship: rerun its command with --data or --task")
        provenance = {
            "name": dest.name,
            "description": f"{o.model} + {self.method} made by `fastforward recipe {self.name}` from {self.data.name}",
            "base": o.model,
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            # a budget in time becomes the tokens it was converted to: the same steps on any machine
            "command": command_line(self.name, self._in_tokens(), self.data, self.work, dest),
            "data": {"source": self.data.name, "sha256": self.plan["data_sha256"], **self.plan["records"]},
            "plan": {k: v for k, v in self.plan.items() if k not in ("data", "data_sha256", "records")},
            "dev": record,
        }
        start = Path(self.start) / "provenance.json"
        if start.exists():  # a model made elsewhere (MultiTF's SBD preset): how that one was made
            provenance["start"] = json.loads(start.read_text())
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.flattened(), tmp)
        write_decoding_defaults(tmp, DecodingDefaults(**record["defaults"]))
        write_json_atomic(tmp / "provenance.json", provenance)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        self.log(f"shipped {dest}")

    def run(self, ship_to: Path | None = None, evaluate: bool = True) -> dict[str, Any] | None:
        """Every stage not yet done; the dev record (None with `evaluate` off)."""
        if self.has_sft:
            self._ntp("sft", self.options.model, self.train_records, self.work / "sft")
        points = self._train_method()
        if self.options.control:
            self._ntp("control", self.start, self.train_records, self.work / "control", self.steps)
        if not evaluate:
            return None
        began = time.monotonic()
        record = self._dev(points)
        self.log(f"dev: {time.monotonic() - began:.0f} s of evaluation (not counted in --budget)")
        write_decoding_defaults(self.flattened(), DecodingDefaults(**record["defaults"]))
        if ship_to is not None:
            self.ship(ship_to, record)
        return record


RECIPES: Registry[type[Recipe]] = Registry("recipe", "fastforward.recipes")
# `@register(name)` on a `Recipe` subclass declares it as `fastforward recipe NAME`.
register = RECIPES.named


def reopen(work: Path, log: Callable[[str], None] = print) -> Recipe:
    """The recipe run in `work`, from its plan alone (the recipe and its training options; evaluation options at
    their defaults): what a benchmark measures a finished run's model and decoders with."""
    path = Path(work) / "plan.json"
    if not path.exists():
        raise FastForwardError(f"{work} holds no recipe run (no plan.json)")
    plan = json.loads(path.read_text())
    recipe_class = RECIPES[plan["recipe"]]
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in plan["options"].items()}
    return recipe_class(None, Path(work), recipe_class.options_class(**given), log=log)
