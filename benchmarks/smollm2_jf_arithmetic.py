"""Jacobi Forcing on SmolLM2-135M-Instruct for grade-school arithmetic, sized for 2 CPU cores: the recipe,
its learning curve, its control and its figures (issue 59).

Stages, each resumable (rerun the same command: finished stages are skipped, an unfinished training
run continues from its last checkpoint):

1. data: `--problems` problems of the `arithmetic` task's train split (TASK options) with their worked
   solutions, as prompt/completion records asked through the chat template (WORK/train.jsonl);
2. sft: the domain-tuned start, an `ntp` LoRA adapter on that data (`--sft-steps`), as CLLM's targets
   were tuned to their domain first (WORK/sft);
3. jf: `jacobi_forcing` from the SFT model, a second LoRA adapter over it, on the same ground-truth
   responses with states that need no rollout (`--states`, default random-tail; `--noise-schedule`
   random), adapter snapshots at the steps of `--curve` (WORK/jf, WORK/curve/step-N);
4. control: the SFT model trained on with `ntp` on the same data for as many steps (WORK/control);
5. evaluation (`--skip-eval` leaves it out), on held-out test problems at `generate`'s defaults (int4
   `--exact`), batch 1, greedy: every curve point's AR accuracy and `jacobi` TPF on `--curve-n` problems
   (point 0: the SFT model); at the last point, on `--n` problems, `ar`, `jacobi` (`--block-size` and 8)
   and `lookup` of the JF model and `ar` and `lookup` of the base, interleaved per problem, with whether
   each one's tokens equal its model's `ar`; the JF model's AR at float32, at int4, and merged into the
   weights before int4 (what loading did before issue 59) on `--curve-n` problems; the control's AR.
   The evaluation runs before the control trains, then again for the control's row alone: each part
   is kept in WORK/curve.json and a rerun computes only what it lacks.

Writes WORK/curve.json and prints the tables; `--ship-to DIR` then writes the preset: the flattened adapter,
its provenance.json and its decoding.json (the fastest row that gives ar's tokens on every problem).

    python benchmarks/smollm2_jf_arithmetic.py                       # the recipe (about 2 hours on 2 cores)
    python benchmarks/smollm2_jf_arithmetic.py --problems 64 --sft-steps 2 --steps 4 --curve 2 \\
        --n 4 --curve-n 2 --work runs/jf-arith-smoke                 # a smoke run of every stage
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import load_average, log, machine_info, set_threads

from fastforward.api import build_decoder
from fastforward.decoding.model_defaults import DecodingDefaults, write_decoding_defaults
from fastforward.model import Model, load_model
from fastforward.model.adapters import ADAPTER_CONFIG
from fastforward.model.flatten import flatten
from fastforward.recipes.dev_eval import choose_defaults
from fastforward.tasks import get_task
from fastforward.training.data import PackedData, load_examples
from fastforward.training.objectives import JacobiForcing, make_objective
from fastforward.training.run_dir import finished_run, model_identity
from fastforward.training.run_dir import save_adapter_snapshot as save_snapshot
from fastforward.training.run_dir import tokens_seen as tokens_at
from fastforward.training.trainer import TrainConfig, train
from fastforward.training.trajectories.dataset import TrajectoryData, from_examples

BASE = "smollm2-135m"
DESCRIPTION = "SmolLM2-135M-Instruct + a Jacobi Forcing LoRA adapter for grade-school arithmetic word problems"
TASK = {"min_ops": 2, "max_ops": 3, "max_number": 20, "max_factor": 5}


# ---- training ---------------------------------------------------------------------------------------------
def write_data(args, work: Path) -> Path:
    path = work / "train.jsonl"
    if not path.exists():
        examples = get_task("arithmetic", **TASK).examples("train", n=args.problems, seed=0)
        tmp = path.with_name(".train.jsonl.tmp")
        tmp.write_text("".join(json.dumps({"prompt": e.prompt, "completion": e.completion}) + "\n" for e in examples))
        os.replace(tmp, path)
    return path


def config(args, steps: int, batch_size: int, lr: float, lora_from: Path | None = None) -> TrainConfig:
    return TrainConfig(
        steps=steps, seq_len=args.seq_len, batch_size=batch_size, lr=lr, warmup=args.warmup,
        mixed_precision="bf16" if args.bf16 else "no", save_every=args.save_every, eval_every=0,
        keep_checkpoints=1, lora_rank=args.lora_rank, lora_from=str(lora_from or ""),
    )  # fmt: skip


def train_ntp(start: str, data: Path, run: Path, args, steps: int, lr: float, lora_from: Path | None = None) -> None:
    if finished_run(run):
        return
    model = load_model(start)
    rows = PackedData(load_examples(data, model.tokenizer), args.seq_len, model.pad_token_id)
    log(f"ntp from {start}: {steps} steps of {args.ntp_batch_size} rows of {args.seq_len} → {run}")
    train(model, make_objective("ntp"), rows, config(args, steps, args.ntp_batch_size, lr, lora_from), run)


def objective(args, more: bool = False) -> JacobiForcing:
    """The Jacobi Forcing objective of the first run, or of the --more-steps (their own AR weight)."""
    ar_weight = args.more_ar_weight if more and args.more_ar_weight is not None else args.ar_weight
    return JacobiForcing(
        noise_schedule=args.noise_schedule, noise_window=args.block_size, ar_weight=ar_weight,
        states=args.states, block_size=args.block_size,
    )  # fmt: skip


def train_jf(start: str, data: Path, work: Path, args, more: bool = False) -> list[int]:
    """Train (or resume) Jacobi Forcing and write the snapshots of --curve; returns the curve's steps.
    `more`: the --more-steps that continue the finished adapter (WORK/jf-more), its steps counted on from
    the first run's."""
    first = args.steps if more else 0
    steps = args.more_steps if more else args.steps
    points = sorted({int(s) for s in args.curve.split(",") if first < int(s) < first + steps} | {first + steps})
    run = work / ("jf-more" if more else "jf")
    if finished_run(run):
        return points
    model = load_model(start)
    examples = from_examples(load_examples(data, model.tokenizer), args.block_size, model.pad_token_id)
    rows = TrajectoryData(examples, args.seq_len)
    chosen = objective(args, more)
    provenance = {
        "base": model_identity(start),
        "objective": chosen.describe(),
        "recipe": "benchmarks/smollm2_jf_arithmetic.py",
    }

    def snapshot(step: int, record: dict) -> None:
        if first + step in points and step < steps:
            save_snapshot(model, work / "curve" / f"step-{first + step:05d}", {**provenance, "step": first + step})

    (work / "curve").mkdir(parents=True, exist_ok=True)
    log(f"jacobi_forcing from {start}: {steps} steps of {args.batch_size} rows, LoRA {args.lora_rank} → {run}")
    lr, lora_from = (args.more_lr, work / "jf") if more else (args.lr, None)
    train(model, chosen, rows, config(args, steps, args.batch_size, lr, lora_from), run, callback=snapshot)
    return points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("runs/jf-arithmetic"))
    p.add_argument("--problems", type=int, default=3000, help="train problems with worked solutions")
    p.add_argument("--sft-steps", type=int, default=100, help="ntp steps of the domain-tuned start")
    p.add_argument("--steps", type=int, default=300, help="Jacobi Forcing steps (and the control's)")
    p.add_argument("--curve", default="50,100,200,400,500", help="JF steps whose adapter is kept and evaluated")
    p.add_argument(
        "--more-steps",
        type=int,
        default=300,
        help="steps that continue the finished JF adapter (and the control), a fresh schedule; 0: none",
    )
    p.add_argument("--more-lr", type=float, default=5e-4, help="peak learning rate of the --more-steps")
    p.add_argument("--batch-size", type=int, default=16, help="Jacobi Forcing rows per step")
    p.add_argument("--ntp-batch-size", type=int, default=8, help="ntp rows per step (packed rows of --seq-len)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--block-size", type=int, default=16, help="training blocks, noise window and jacobi's block")
    p.add_argument("--states", default="random-tail", help="the jacobi_forcing objective's state source")
    p.add_argument("--noise-schedule", default="random")
    p.add_argument("--ar-weight", type=float, default=1.0, help="weight of the AR loss beside the consistency loss")
    p.add_argument("--more-ar-weight", type=float, help="the AR weight of the --more-steps (default: --ar-weight)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast in training")
    p.add_argument("--n", type=int, default=300, help="held-out problems at the last point")
    p.add_argument("--curve-n", type=int, default=60, help="held-out problems at the other points")
    p.add_argument("--blocks", default="16,12,8", help="jacobi block sizes of the last point's table")
    p.add_argument(
        "--base-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the base model's ar and lookup on the --n problems too (last)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-eval", action="store_true", help="train only (the control too)")
    p.add_argument("--skip-control", action="store_true", help="neither train nor evaluate the NTP control")
    p.add_argument(
        "--ship-to",
        type=Path,
        help="after the evaluation, write the shipped adapter, its provenance.json and its decoding.json (the "
        "fastest lossless row of the last point) here",
    )
    args = p.parse_args()
    threads = set_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = write_data(args, work)
    sft = str(work / "sft")
    train_ntp(BASE, data, work / "sft", args, args.sft_steps, args.lr)
    points = train_jf(sft, data, work, args)
    if args.more_steps:
        points = sorted(set(points) | set(train_jf(sft, data, work, args, more=True)))
    log(f"SFT and Jacobi Forcing: {time.perf_counter() - started:.0f} s")

    def control() -> None:
        train_ntp(sft, data, work / "control", args, args.steps, args.lr)
        if args.more_steps:
            train_ntp(sft, data, work / "control-more", args, args.more_steps, args.more_lr, work / "control")

    if args.skip_eval:
        control()
        return
    evaluate(args, work, points, threads)  # the control's row too, once it has trained
    if not args.skip_control:
        control()
        evaluate(args, work, points, threads)


# ---- evaluation -------------------------------------------------------------------------------------------
SERVED = {"quantize": "int4", "exact": True}  # `fastforward generate`'s defaults for the preset


def decode(model: Model, name: str, prompts: list[list[int]], args, **options) -> list:
    decoder = build_decoder(name, **options)
    return [decoder.generate(model, [p], args.max_new_tokens)[0] for p in prompts]


def summary(generations: list, examples: list, reference: list | None = None) -> dict:
    """Accuracy, TPF, tokens/s (generation seconds, prefill included) and, against `reference`
    (the same model's ar), how many outputs are the same tokens."""
    task = get_task("arithmetic", **TASK)
    tokens = sum(g.stats.tokens for g in generations)
    row = {
        "accuracy": sum(task.grade(e, g.text).correct for e, g in zip(examples, generations, strict=True))
        / len(examples),
        "tpf": tokens / max(sum(g.stats.nfe for g in generations), 1),
        "tps": tokens / sum(g.stats.seconds for g in generations),
        "tokens": tokens,
        "n": len(examples),
    }
    if reference is not None:
        row["equal_ar"] = sum(g.token_ids == r.token_ids for g, r in zip(generations, reference, strict=True))
    return row


def interleaved(contenders: dict, prompts: list[list[int]], args) -> dict[str, list]:
    """Every contender (label: (model, decoder name, options)) on each prompt in turn, so that load
    changes fall on all of them alike."""
    out: dict[str, list] = {label: [] for label in contenders}
    decoders = {label: build_decoder(name, **options) for label, (_, name, options) in contenders.items()}
    for prompt in prompts:
        for label, (model, _, _) in contenders.items():
            out[label].append(decoders[label].generate(model, [prompt], args.max_new_tokens)[0])
    return out


def isa() -> list[str]:
    """The CPU's vector and matrix instruction sets (what the int4 kernel and bfloat16 arithmetic use)."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return sorted(f for f in flags.split() if f.startswith(("avx512", "amx", "avx2", "avx_vnni")))


def jf_model(work: Path, args, step: int) -> Path:
    """The JF model after `step` steps: the SFT model at 0, a run's final adapter, or a curve snapshot."""
    if step == 0:
        return work / "sft"
    if step == args.steps:
        return work / "jf"
    if args.more_steps and step == args.steps + args.more_steps:
        return work / "jf-more"
    return work / "curve" / f"step-{step:05d}"


def block_sizes(args) -> list[int]:
    """--blocks: the jacobi block sizes of the last point's rows."""
    return [int(b) for b in args.blocks.split(",")]


def final_decoders(blocks: list[int]) -> dict[str, tuple[str, dict]]:
    """The last point's rows of the shipped adapter (label: decoder, options): ar, jacobi at each block, lookup."""
    jacobi = {f"jf jacobi-{b}": ("jacobi", {"block_size": b}) for b in blocks}
    return {"jf ar": ("ar", {}), **jacobi, "jf lookup": ("lookup", {})}


def fastest(rows: dict, blocks: list[int], processor: str) -> DecodingDefaults:
    """The preset's decoding defaults, chosen from the last point's rows as the recipe chooses them."""
    where = (
        f"{rows['jf ar']['n']} held-out arithmetic problems, int4 --exact, batch 1, 2 threads, {processor}; "
        "python benchmarks/smollm2_jf_arithmetic.py (its command and figures: provenance.json)"
    )
    return choose_defaults(rows, final_decoders(blocks), where)


def ship(work: Path, last: Path) -> Path:
    """The SFT and JF adapters flattened into one bfloat16 adapter over the base: what the preset ships."""
    shipped = work / "shipped"
    if not (shipped / ADAPTER_CONFIG).exists():
        flatten([work / "sft", last], shipped, BASE)
    return shipped


def evaluate(args, work: Path, points: list[int], threads: int) -> None:
    """Each part of the evaluation once: a rerun (say, after the control finished training) computes
    only the parts WORK/curve.json lacks. Timed parts interleave their contenders."""
    path = work / "curve.json"
    record = json.loads(path.read_text()) if path.exists() else {"args": {k: str(v) for k, v in vars(args).items()}}
    examples = get_task("arithmetic", **TASK).examples("test", n=args.n, seed=1)
    base = load_model(BASE, **SERVED)
    prompts = [base.encode_prompt(e.prompt) for e in examples]
    few, few_prompts = examples[: args.curve_n], prompts[: args.curve_n]
    last_step = points[-1]
    shipped = ship(work, jf_model(work, args, last_step))
    blocks = block_sizes(args)
    jacobi = {"block_size": args.block_size}

    def save(name: str, value, before: list[float]) -> None:
        record[name] = value
        record.setdefault("runs", {})[name] = {"threads": threads, "load_before": before, "load_after": load_average()}
        record.setdefault("machine", {**machine_info(), "isa": isa()})
        path.write_text(json.dumps(record, indent=2) + "\n")

    def part(name: str, compute) -> None:
        if name not in record:
            before = load_average()
            save(name, compute(), before)
            log(f"{name}: {json.dumps(record[name])}")

    def curve() -> None:
        """Every curve point not yet in the record, each saved as it finishes."""
        seen = tokens_at(work / "jf")
        if args.more_steps and (work / "jf-more" / "metrics.jsonl").exists():
            seen |= {args.steps + k: v + seen[args.steps] for k, v in tokens_at(work / "jf-more").items()}
        for step in [0, *points]:  # step 0: the SFT model, where Jacobi Forcing starts
            if any(p["step"] == step for p in record.get("curve", [])):
                continue
            before, model = load_average(), load_model(str(jf_model(work, args, step)), **SERVED)
            out = interleaved({"ar": (model, "ar", {}), "jacobi": (model, "jacobi", jacobi)}, few_prompts, args)
            row = {"step": step, "tokens": seen.get(step, 0.0), "ar": summary(out["ar"], few),
                   "jacobi": summary(out["jacobi"], few, out["ar"])}  # fmt: skip
            save("curve", sorted([*record.get("curve", []), row], key=lambda p: p["step"]), before)
            log(f"curve point: {json.dumps(row)}")

    def final() -> dict:
        """The shipped adapter, at the preset's precision: ar, jacobi at each of --blocks, lookup."""
        model = load_model(str(shipped), **SERVED)
        contenders = {label: (model, name, options) for label, (name, options) in final_decoders(blocks).items()}
        out = interleaved(contenders, prompts, args)
        return {label: summary(g, examples, None if label == "jf ar" else out["jf ar"]) for label, g in out.items()}

    def base_rows() -> dict:
        out = interleaved({"base ar": (base, "ar", {}), "base lookup": (base, "lookup", {})}, prompts, args)
        return {label: summary(g, examples, None if label == "base ar" else out["base ar"]) for label, g in out.items()}

    def flattened() -> dict:
        """The shipped adapter (flattened, bfloat16) against the chain it was made from (float32 adapters),
        both at the preset's defaults, and at float32."""
        runs = {
            "chain, int4": decode(load_model(str(jf_model(work, args, last_step)), **SERVED), "ar", few_prompts, args),
            "shipped, int4": decode(load_model(str(shipped), **SERVED), "ar", few_prompts, args),
            "shipped, float32": decode(load_model(str(shipped)), "ar", few_prompts, args),
        }
        return {label: summary(g, few, runs["chain, int4"]) for label, g in runs.items()}

    def precision() -> dict:
        """The adapter at float32, kept beside int4 weights, and merged into them before int4 quantization
        (what loading did before issue 59)."""
        merged_dir = work / "jf-merged"
        if not (merged_dir / "config.json").exists():
            load_model(str(work / "jf")).save(merged_dir)
        runs = {
            "float32": decode(load_model(str(work / "jf")), "ar", few_prompts, args),
            "int4, kept apart": decode(load_model(str(work / "jf"), **SERVED), "ar", few_prompts, args),
            "int4, merged first": decode(load_model(str(merged_dir), **SERVED), "ar", few_prompts, args),
        }
        return {label: summary(g, few, runs["float32"]) for label, g in runs.items()}

    curve()
    part(f"final-step-{last_step}", final)
    part(f"flattened-step-{last_step}", flattened)
    part(f"precision-step-{args.steps}", precision)
    control = work / ("control-more" if args.more_steps else "control")
    if finished_run(control):
        run = lambda: summary(decode(load_model(str(control), **SERVED), "ar", prompts, args), examples)  # noqa: E731
        part(f"control-step-{last_step}", run)
    if args.base_rows:
        part("base", base_rows)
    record["adapter_bytes"] = sum(f.stat().st_size for f in shipped.glob("adapter_model.*"))
    path.write_text(json.dumps(record, indent=2) + "\n")
    print_tables(record, last_step)
    log(f"wrote {path}")
    if args.ship_to:
        ship_preset(args, work, record, last_step, args.ship_to)


def ship_preset(args, work: Path, record: dict, last_step: int, dest: Path) -> None:
    """The flattened adapter, what made it (commit, command, data, training, the last point's figures) and
    the decoder it decodes with by default (`fastest`), as a preset directory (`fastforward/presets/<name>`):
    written beside `dest`, then renamed onto it."""
    data = work / "train.jsonl"
    provenance = {
        "name": dest.name,
        "description": DESCRIPTION,
        "base": BASE,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": "python benchmarks/smollm2_jf_arithmetic.py " + " ".join(sys.argv[1:]),
        "task": {"name": "arithmetic", "options": TASK, "chat_template": True},
        "data": {"split": "train", "problems": args.problems, "seed": 0,
                 "sha256": hashlib.sha256(data.read_bytes()).hexdigest()},
        "training": {
            "sft": {"objective": "ntp", "steps": args.sft_steps, "lr": args.lr},
            "jacobi_forcing": {
                "objective": json.loads((work / "jf" / "fastforward_adapter.json").read_text())["objective"],
                "steps": last_step, "tokens": next(p["tokens"] for p in record["curve"] if p["step"] == last_step),
                "schedule": f"{args.steps} steps at LR {args.lr:g}, then {args.more_steps} more at {args.more_lr:g}",
                "more_objective": objective(args, more=True).describe() if args.more_steps else None,
            },
        },
        "measured": {"at": "int4 --exact, batch 1, greedy, 2 threads", "problems": args.n,
                     **record[f"final-step-{last_step}"], "machine": record.get("machine")},
        "recorded": "benchmarks/recorded/ (the run's curve.json)",
    }  # fmt: skip
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(work / "shipped", tmp)
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    processor = (record.get("machine") or {}).get("processor", "unknown CPU")
    write_decoding_defaults(tmp, fastest(record[f"final-step-{last_step}"], block_sizes(args), processor))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    log(f"shipped {dest}")


def print_tables(record: dict, last_step: int) -> None:
    log("\n| JF step | training tokens | AR accuracy | jacobi TPF | jacobi = ar |\n|---|---|---|---|---|")
    for p in record.get("curve", []):
        log(f"| {p['step']} | {p['tokens']:.0f} | {p['ar']['accuracy']:.1%} | {p['jacobi']['tpf']:.2f} "
            f"| {p['jacobi']['equal_ar']} of {p['jacobi']['n']} |")  # fmt: skip
    final = {**record.get(f"final-step-{last_step}", {}), **record.get("base", {})}
    if f"control-step-{last_step}" in record:
        final["control ar"] = record[f"control-step-{last_step}"]
    log("\n| model, decoder | accuracy | TPF | tokens/s | × its ar | × its lookup | = its ar |")
    log("|---|---|---|---|---|---|---|")
    for label, row in final.items():
        model = label.split()[0]
        own_ar, own_lookup = (final.get(f"{model} {d}", {}).get("tps", 0.0) for d in ("ar", "lookup"))
        equal = f"{row['equal_ar']} of {row['n']}" if "equal_ar" in row else ""
        ratios = " | ".join(f"{row['tps'] / own:.2f}" if own else "" for own in (own_ar, own_lookup))
        log(f"| {label} | {row['accuracy']:.1%} | {row['tpf']:.2f} | {row['tps']:.1f} | {ratios} | {equal} |")
    log(f"\nflattened: {json.dumps(record.get(f'flattened-step-{last_step}'))}")
    log(f"shipped adapter: {record['adapter_bytes'] / 2**20:.1f} MiB; load: {json.dumps(record.get('runs'))}")


if __name__ == "__main__":
    main()
