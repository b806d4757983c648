"""Jacobi decoding and Jacobi Forcing: TPF, accuracy, losslessness and wall-clock speed (issue 4, part 5).

Stages, all on one machine in one run:

1. **untrained**: plain Jacobi (`jacobi`) and multi-block + recycling Jacobi (`jacobi-mr`) TPF of the
   model as it is, on held-out prompts (the paper expects ≈ 1.0–1.1), with AR accuracy and the
   count of outputs identical to greedy AR;
2. **Jacobi Forcing**: progressive rounds (`fastforward jacobi-forcing`, run in-process) on prompts
   of the task's train split: collect the model's Jacobi trajectories, train with the
   jacobi_forcing objective, repeat at the next block size;
3. **trained**: the same figures for each round's model (at its round's block size; the last
   round's model is the trained one) on the same held-out prompts: accuracy
   before and after (target: within 2 points), `jacobi` and `jacobi-mr` TPF (target ≥ 2.5), and
   that every Jacobi output equals the trained model's own greedy AR output;
4. **multi-block + recycling vs plain Jacobi** on the same model (target: TPF ≥ 1.10 ×);
5. **wall clock**: TPS of our AR, `jacobi`, `jacobi-mr`, transformers' greedy `generate` and its
   prompt-lookup decoding (`prompt_lookup_num_tokens`, lossless too) on the same model, prompts
   and machine, interleaved prompt by prompt (`fastforward.evaluation.evaluate.compare`), `--repeats` times;
   the median of the repeats counts.

The default model is the demo's NTP model (`runs/demo/ntp`, written by `fastforward demo`); when it
is missing, a model is built the way the demo builds it (`fastforward.demo.pipeline.pretrain` + `finetune`)
under `--work` and reused by later runs. Trained models and trajectories live under `--work` too,
in a directory named after the settings, so a rerun with the same settings reuses (or resumes) them.

    python benchmarks/jacobi.py --quick                       # smoke run, 1–2 minutes
    python benchmarks/jacobi.py                               # the demo's arithmetic model (≈ 30 min)
    python benchmarks/jacobi.py --model smollm2-135m --task pycode --no-train \\
        --eval-prompts 8 --timing-prompts 8 --max-new-tokens 128

Prints a table per stage and writes benchmarks/results/jacobi.json (one entry per model and task;
other entries of the file are kept). Load averages are recorded next to every timing: the machines
are shared, and timings taken under load are noisy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from common import HFGenerate, load_average, log, machine_info, set_threads

from fastforward.api import build_decoder
from fastforward.evaluation.evaluate import AR, compare
from fastforward.evaluation.report import write_json
from fastforward.model import load_model
from fastforward.tasks import get_task, parse_options

DEMO_MODEL = Path("runs/demo/ntp")
DEMO_SETTINGS = Path("runs/demo/demo.json")
TASK_KNOBS = ("min_ops", "max_ops", "max_number", "max_factor")


# ---- the model ------------------------------------------------------------------------------------
def demo_config(quick: bool, pretrain_steps: int = 0, finetune_steps: int = 0):
    """The demo's settings (smaller training budgets with --quick)."""
    from dataclasses import replace

    from fastforward.demo.pipeline import PRESETS

    # --quick: the demo's seconds-long smoke model (its accuracy is meaningless), a longer budget
    if quick:
        return replace(PRESETS["smoke"], max_new_tokens=48)
    config = PRESETS["default"]
    steps = {"pretrain_steps": pretrain_steps or config.pretrain_steps}
    steps["finetune_steps"] = finetune_steps or config.finetune_steps
    return replace(config, **steps)


def settings_beside(model: Path) -> tuple[dict, int | None]:
    """Task options and budget of a model trained by the demo or benchmarks/sbd_vs_ntp.py, read from
    the settings file they leave next to it (demo.json, bench.json); none for any other model."""
    for name in (DEMO_SETTINGS.name, "bench.json"):
        path = model.parent / name
        if path.exists():
            saved = json.loads(path.read_text())
            log(f"task options of {model} from {path}")
            return {k: saved[k] for k in TASK_KNOBS if k in saved}, demo_config(False).max_new_tokens
    return {}, None


def resolve_model(args) -> tuple[str, dict, int | None]:
    """(model path or preset, task options, generation budget) for `--model`."""
    if args.model != "auto":
        return args.model, *settings_beside(Path(args.model))
    if (DEMO_MODEL / "config.json").exists():
        saved = json.loads(DEMO_SETTINGS.read_text()) if DEMO_SETTINGS.exists() else {}
        options = {k: saved[k] for k in TASK_KNOBS if k in saved}
        log(f"model: the demo's NTP model {DEMO_MODEL} (task options {options})")
        return str(DEMO_MODEL), options, demo_config(False).max_new_tokens
    from fastforward.demo.pipeline import finetune, pretrain

    config = demo_config(args.quick, args.pretrain_steps, args.finetune_steps)
    name = "demo-model-quick" if args.quick else "demo-model"
    if not args.quick and (args.pretrain_steps or args.finetune_steps):
        name += f"-{config.pretrain_steps}-{config.finetune_steps}"
    root = Path(args.work) / name
    if not (root / "ntp" / "config.json").exists():
        log(f"model: {DEMO_MODEL} not found; building one the way the demo does → {root}")
        started = time.perf_counter()
        pretrain(config, root / "pretrain", log)
        finetune(config, root / "pretrain", root / "ntp", "ntp", log)
        log(f"model built in {time.perf_counter() - started:.0f} s")
    else:
        log(f"model: {root / 'ntp'} (built earlier the way the demo does)")
    options = {k: getattr(config, k) for k in TASK_KNOBS}
    return str(root / "ntp"), options, config.max_new_tokens


# ---- Jacobi Forcing ---------------------------------------------------------------------------------
def jf_argv(args, model: str, task_options: dict, budget: int, out: Path) -> list[str]:
    argv = ["jacobi-forcing", "--model", model, "--out", str(out), "--task", args.task]
    for key, value in task_options.items():
        argv += ["--task-option", f"{key}={value}"]
    argv += ["--split", "train", "--n", str(args.train_prompts), "--max-new-tokens", str(budget)]
    argv += ["--rounds", str(args.rounds), "--block-sizes", *map(str, args.block_sizes)]
    argv += ["--noise-windows", *map(str, args.noise_windows), "--steps", str(args.steps)]
    argv += ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--lr", str(args.lr)]
    argv += ["--warmup", str(args.warmup), "--ar-weight", str(args.ar_weight), "--dtype", args.dtype]
    argv += ["--noise-schedule", args.noise_schedule, "--noisy-context", args.noisy_context]
    argv += ["--collect-batch-size", "16", "--save-every", str(max(1, args.steps // 4)), "--keep-checkpoints", "1"]
    if args.lora_rank:
        argv += ["--lora-rank", str(args.lora_rank)]
    if args.bf16 is not None:
        argv.append("--bf16" if args.bf16 else "--no-bf16")
    if not args.chat_template:
        argv.append("--no-chat-template")
    if args.only_correct:
        argv.append("--only-correct")
    return argv


def jacobi_forcing(args, model: str, task_options: dict, budget: int) -> tuple[str, dict]:
    """Run the progressive rounds in-process (resumable); returns the final model's directory."""
    from fastforward.cli import jacobi_forcing as jf_cli

    key = json.dumps({"model": str(Path(model).resolve()), "argv": jf_argv(args, model, task_options, budget, Path())})
    out = Path(args.work) / f"jf-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    if args.retrain:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(key + "\n")
    argv = jf_argv(args, model, task_options, budget, out)
    log("jacobi forcing: fastforward " + " ".join(argv))
    parser = argparse.ArgumentParser(prog="fastforward")
    jf_cli.register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    started = time.perf_counter()
    ns.run(ns)
    seconds = time.perf_counter() - started
    final = out / f"round-{args.rounds}"
    rounds = []
    for r in range(1, args.rounds + 1):
        metrics = [json.loads(line) for line in (out / f"round-{r}" / "metrics.jsonl").read_text().splitlines()]
        train_rows = [m for m in metrics if m.get("split") == "train"]
        rounds.append(
            {
                "round": r,
                "block_size": args.block_sizes[min(r, len(args.block_sizes)) - 1],
                "first_loss": round(train_rows[0]["loss"], 4),
                "last_loss": round(train_rows[-1]["loss"], 4),
                "trajectory_tpf": trajectory_tpf(out / f"trajectories-round-{r}.jsonl"),
            }
        )
    return str(final), {"dir": str(out), "argv": argv, "seconds_this_run": round(seconds, 1), "rounds": rounds}


def trajectory_tpf(path: Path) -> float:
    """Tokens per Jacobi forward of a trajectory file (fixed-span blocks, counted whole)."""
    tokens = forwards = 0
    for line in path.read_text().splitlines():
        blocks = json.loads(line)["blocks"]
        forwards += sum(len(b["states"]) + 1 for b in blocks)
        tokens += sum(len(b["fixed"]) for b in blocks)
    return round(tokens / forwards, 3) if forwards else 0.0


# ---- measuring ------------------------------------------------------------------------------------
def jacobi_decoders(args, block_size: int | None = None) -> dict:
    n = block_size or args.decode_block_size
    return {
        "jacobi": build_decoder("jacobi", block_size=n),
        "jacobi-mr": build_decoder(
            "jacobi-mr",
            block_size=n,
            max_blocks=args.mr_blocks,
            spawn_ratio=args.mr_spawn,
            verify=args.mr_verify,
            ngram=args.mr_ngram,
        ),
    }


def quality_rows(results: dict, labels=(AR, "jacobi", "jacobi-mr")) -> dict:
    """Accuracy, TPF and the count of outputs identical to greedy AR, per decoder of a `compare` result."""
    rows = {}
    for label in labels:
        row = results[label].summary()
        row["identical_to_ar"] = sum(r["agree_exact"] for r in results[label].records)
        row["accuracy_minus_ar"] = round(row["accuracy"] - results[AR].accuracy, 3)
        rows[label] = row
    return rows


def report_quality(stage: str, model_path: str, task, rows: dict, load: list) -> dict:
    ratio = rows["jacobi-mr"]["tpf"] / rows["jacobi"]["tpf"]
    n = rows[AR]["n"]
    log(f"\n[{stage}] {model_path} on {n} held-out {task.name} prompts (load {load[0]} → {load[1]})")
    log(f"{'decoder':<11}{'acc %':>7}{'tokens':>8}{'nfe':>7}{'tpf':>7}{'identical':>11}")
    for label, r in rows.items():
        log(
            f"{label:<11}{r['accuracy']:>7.1f}{r['tokens']:>8}{r['nfe']:>7}{r['tpf']:>7.3f}"
            f"{r['identical_to_ar']:>6}/{r['n']:<4}"
        )
    log(f"jacobi-mr TPF / jacobi TPF: {ratio:.3f}")
    return {"model": model_path, "n": n, "load_average": load, "rows": rows, "mr_over_jacobi_tpf": round(ratio, 4)}


def quality(model_path: str, args, task, examples, budget: int, stage: str, block_size: int | None = None) -> dict:
    """Accuracy, TPF and agreement with greedy AR of AR, jacobi and jacobi-mr on the held-out prompts
    (decoding blocks of `block_size`, default --decode-block-size)."""
    model = load_model(model_path, dtype=args.dtype)
    load = load_average()
    results = compare(
        model,
        task,
        jacobi_decoders(args, block_size),
        examples,
        max_new_tokens=budget,
        chat_template=args.chat_template,
        desc=stage,
    )
    return report_quality(stage, model_path, task, quality_rows(results), [load, load_average()])


def timing(model_path: str, args, task, examples, budget: int) -> dict:
    """TPS of our AR, jacobi, jacobi-mr and transformers' greedy and prompt-lookup generate; interleaved.

    Also returns the quality figures (accuracy, TPF, identical outputs) of the first repeat."""
    model = load_model(model_path, dtype=args.dtype)
    decoders = {
        **jacobi_decoders(args),
        "hf-generate": HFGenerate(),
        "hf-prompt-lookup": HFGenerate(prompt_lookup_num_tokens=args.prompt_lookup),
    }
    repeats = []
    for i in range(args.repeats):
        load = load_average()
        results = compare(
            model,
            task,
            decoders,
            examples,
            max_new_tokens=budget,
            chat_template=args.chat_template,
            warmup=i == 0,
            desc=f"timing {i + 1}/{args.repeats}",
        )
        repeats.append({"load_average": [load, load_average()], "results": results})
    rows = {}
    for label in repeats[0]["results"]:
        runs = [rep["results"][label] for rep in repeats]
        first = runs[0]
        seconds = statistics.median(r.seconds for r in runs)
        rows[label] = {
            "decoder": first.decoder,
            "knobs": first.knobs,
            "tokens": first.tokens,
            "nfe": first.nfe,
            "tpf": round(first.tpf, 4),
            "median_seconds": round(seconds, 4),
            "tps": round(first.tokens / seconds, 3),
            "tps_each_repeat": [round(r.tps, 3) for r in runs],
            "identical_to_ar": sum(rec["agree_exact"] for rec in first.records),
            "accuracy": round(first.accuracy, 3),
        }
    for row in rows.values():
        row["speedup_vs_ar"] = round(row["tps"] / rows[AR]["tps"], 4)
        row["speedup_vs_prompt_lookup"] = round(row["tps"] / rows["hf-prompt-lookup"]["tps"], 4)
    log(
        f"\n[wall clock] {model_path}: {len(examples)} prompts × ≤{budget} tokens, batch 1, "
        f"{torch.get_num_threads()} threads, {args.dtype}, median of {args.repeats} interleaved repeats"
    )
    log(f"load average per repeat (start → end): {[r['load_average'] for r in repeats]}")
    log(f"{'decoder':<18}{'tokens':>8}{'nfe':>7}{'tpf':>7}{'tok/s':>9}{'vs ar':>7}{'vs pl':>7}{'identical':>11}")
    for label, r in rows.items():
        log(
            f"{label:<18}{r['tokens']:>8}{r['nfe']:>7}{r['tpf']:>7.3f}{r['tps']:>9.1f}"
            f"{r['speedup_vs_ar']:>7.2f}{r['speedup_vs_prompt_lookup']:>7.2f}"
            f"{r['identical_to_ar']:>6}/{len(examples):<4}"
        )
    return {
        "model": model_path,
        "n": len(examples),
        "max_new_tokens": budget,
        "load_average": [r["load_average"] for r in repeats],
        "rows": rows,
        "quality_rows": quality_rows(repeats[0]["results"]),
        "quality_load": repeats[0]["load_average"],
    }


# ---- the run --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto", help="model dir or preset (auto: the demo's arithmetic model)")
    ap.add_argument("--task", default=None, help="graded task (default: arithmetic; pycode for smollm2-135m)")
    ap.add_argument("--task-option", action="append", metavar="NAME=VALUE", help="task option (repeatable)")
    ap.add_argument("--quick", action="store_true", help="a 1–2 minute smoke run (small budgets everywhere)")
    ap.add_argument("--no-train", action="store_true", help="skip Jacobi Forcing (untrained figures and timing)")
    ap.add_argument("--retrain", action="store_true", help="train again even if the same settings were trained")
    ap.add_argument("--pretrain-steps", type=int, default=0, help="building a model: NTP steps (0: the demo's)")
    ap.add_argument("--finetune-steps", type=int, default=0, help="building a model: fine-tune steps (0: the demo's)")
    ap.add_argument("--work", default="runs/bench-jacobi", help="directory of built models and trained rounds")
    ap.add_argument("--out", default="benchmarks/results/jacobi.json")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the cores not busy, as the demo)")
    ap.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto", help="auto: off for pycode")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the demo's or the task's budget")
    # prompts
    ap.add_argument("--train-prompts", type=int, default=8000, help="train-split prompts for the trajectories")
    ap.add_argument("--eval-prompts", type=int, default=500, help="held-out (test split) prompts")
    ap.add_argument("--timing-prompts", type=int, default=16, help="held-out prompts timed (a prefix of the eval ones)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats (median counts)")
    # Jacobi Forcing
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32], help="block size of each round")
    ap.add_argument("--noise-windows", type=int, nargs="+", default=[16], help="noise window w of each round")
    ap.add_argument(
        "--noise-schedule",
        default="random",
        choices=("progressive", "random", "reverse"),
        help="random: rows here hold only 2-6 blocks, so eq. 7's progressive schedule would use only t < 6/w",
    )
    ap.add_argument(
        "--noisy-context",
        default="clean",
        choices=("noisy", "clean"),
        help="what a noisy block sees of earlier blocks: noisy (Fig. 2b) or clean (Fig. 2a; docs/results.md's run)",
    )
    ap.add_argument(
        "--only-correct",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train on the trajectories whose response the task grades correct (default: on, off with --quick)",
    )
    ap.add_argument("--steps", type=int, default=2400, help="optimizer steps per round")
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--ar-weight", type=float, default=1.0)
    ap.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: every weight)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="as `fastforward train`'s")
    # decoding
    ap.add_argument("--decode-block-size", type=int, default=None, help="default: the last round's block size")
    ap.add_argument("--mr-blocks", type=int, default=2, help="jacobi-mr: most blocks in flight (K)")
    ap.add_argument("--mr-spawn", type=float, default=0.3, help="jacobi-mr: spawn ratio r")
    ap.add_argument("--mr-verify", type=int, default=8, help="jacobi-mr: recycled n-grams verified per forward")
    ap.add_argument("--mr-ngram", type=int, default=0, help="jacobi-mr: n-gram length (0: the block size)")
    ap.add_argument("--prompt-lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.train_prompts, args.eval_prompts, args.timing_prompts, args.repeats = 48, 12, 4, 1
        args.rounds, args.block_sizes, args.noise_windows, args.steps = 1, [16], [16], 20
    if args.only_correct is None:  # the smoke model may answer nothing right
        args.only_correct = not args.quick
    if args.task is None:
        args.task = "pycode" if "smollm" in args.model.lower() else "arithmetic"
    if args.chat_template == "auto":
        args.chat_template = args.task != "pycode"
    else:
        args.chat_template = args.chat_template == "on"
    args.timing_prompts = min(args.timing_prompts, args.eval_prompts)
    if args.decode_block_size is None:  # the block size of the last round trained, or of the first
        args.decode_block_size = args.block_sizes[0 if args.no_train else min(args.rounds, len(args.block_sizes)) - 1]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.threads = set_threads(args.threads)
    started = time.perf_counter()
    log(f"load average at start: {load_average()} ({torch.get_num_threads()} torch threads)")
    model, task_options, budget = resolve_model(args)
    task_options.update(parse_options(args.task_option))
    task = get_task(args.task, **task_options)
    budget = args.max_new_tokens or budget or task.max_new_tokens
    examples = task.examples("test", args.eval_prompts, seed=0)
    result: dict = {
        "model": model,
        "task": task.describe(),
        "max_new_tokens": budget,
        "args": {k: v for k, v in vars(args).items()},
        "machine": machine_info(),
        "load_average_start": load_average(),
    }
    if args.no_train:  # one interleaved run gives the untrained figures and the timings
        result["timing"] = timing(model, args, task, examples[: args.timing_prompts], budget)
        rows, load = result["timing"].pop("quality_rows"), result["timing"].pop("quality_load")
        result["untrained"] = report_quality("untrained", model, task, rows, load)
    else:
        result["untrained"] = quality(model, args, task, examples, budget, "untrained")
        trained, result["jacobi_forcing"] = jacobi_forcing(args, model, task_options, budget)
        runs = Path(result["jacobi_forcing"]["dir"])
        result["earlier_rounds"] = [  # each round's model at its own block size, to see what a round adds
            quality(str(runs / f"round-{i}"), args, task, examples, budget, f"round {i}", r["block_size"])
            for i, r in enumerate(result["jacobi_forcing"]["rounds"][:-1], start=1)
        ]
        result["trained"] = quality(trained, args, task, examples, budget, "trained")
        before = result["untrained"]["rows"][AR]["accuracy"]
        after = result["trained"]["rows"][AR]["accuracy"]
        trained_rows = result["trained"]["rows"]
        result["targets"] = {
            "accuracy_before": before,
            "accuracy_after": after,
            "accuracy_drop_within_2_points": before - after <= 2.0,
            "jacobi_tpf_after": trained_rows["jacobi"]["tpf"],
            "jacobi_tpf_at_least_2.5": trained_rows["jacobi"]["tpf"] >= 2.5,
            "jacobi_mr_tpf_after": trained_rows["jacobi-mr"]["tpf"],
            "lossless_jacobi": trained_rows["jacobi"]["identical_to_ar"] == len(examples),
            "lossless_jacobi_mr": trained_rows["jacobi-mr"]["identical_to_ar"] == len(examples),
            "mr_over_jacobi_tpf": result["trained"]["mr_over_jacobi_tpf"],
            "mr_at_least_10_percent_higher": result["trained"]["mr_over_jacobi_tpf"] >= 1.10,
        }
        result["timing"] = timing(trained, args, task, examples[: args.timing_prompts], budget)
        del result["timing"]["quality_rows"], result["timing"]["quality_load"]
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["load_average_end"] = load_average()

    out = Path(args.out)
    everything = json.loads(out.read_text()) if out.exists() else {}
    built = Path(model).parent.name if Path(model).parent.parent == Path(args.work) else None
    label = built or ("demo-ntp" if Path(model) == DEMO_MODEL else Path(model).name)
    key = f"{label}/{args.task}" + ("/quick" if args.quick else "")
    everything[key] = result
    write_json(out, everything)

    log(f"\n{key}: {result['seconds']:.0f} s in all; load average {result['load_average_end']}")
    if "targets" in result:
        for name, value in result["targets"].items():
            log(f"  {name}: {value}")
    log(f"wrote {out} [{key}]")
    lossless = all(
        stage["rows"][label]["identical_to_ar"] == stage["n"]
        for stage in (result["untrained"], result.get("trained", result["untrained"]))
        for label in ("jacobi", "jacobi-mr")
    )
    if not lossless:
        log("WARNING: some Jacobi outputs differ from greedy AR (see identical_to_ar)")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
