"""MultiTF post-training recipes on the demo's shipped SBD checkpoint, against training-free MultiBD
and SingleBD of that checkpoint (issue 54: MultiTF must recover what training-free MultiBD loses).

Each candidate starts from `fastforward/demo/checkpoints/sbd` (copied to --out/sbd) and is one call
of the demo's trainer (`fastforward.demo.pipeline.finetune`) with the options below; the old shipped
recipe (LR 5e-4 after a 30-step warmup, blocks 2-16) is the candidate `old_recipe`. A candidate
already in --out is reused. `multitf_shipped` is the MultiTF checkpoint shipped in this tree (copied
once into --out; the note of 2026-11-28 evaluated the old one, shipped before commit 75d7c83;
`lr1e-4_b6_fresh` is the one shipped since). Every model is evaluated on the demo's 150 held-out
problems with the demo's decoders (`fastforward.demo.showcase.Settings`: SingleBD `sbd` block 6,
MultiBD `mbd` block 6 x 3, add 0.5) and the AUP of each model's sbd and mbd sweeps over --accepts.

    python benchmarks/multitf_recipe.py --threads 1 --train lr1e-4_b6_fresh,sbd_lr1e-4_b6 \
        --eval sbd,multitf_shipped,lr1e-4_b6_fresh,sbd_lr1e-4_b6 --accepts 0.9,0.95
    python benchmarks/multitf_recipe.py --threads 1 --steps 2 --n 2 --out /tmp/r --train lr1e-4 --eval lr1e-4  # smoke

Writes benchmarks/results/multitf_recipe.json (or --results DIR): rows, AUPs, targets, paired
counts (problems one model solves and the other does not), load average and machine.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import replace
from pathlib import Path

from common import curve_aup, log, machine_info, print_targets, result_columns, result_row, set_threads

from fastforward.api import build_decoder
from fastforward.demo.pipeline import DemoConfig, finetune
from fastforward.demo.showcase import Settings
from fastforward.demo.zoo import Stage, write_provenance, write_task_options
from fastforward.evaluation.evaluate import compare
from fastforward.evaluation.report import format_table, write_json
from fastforward.model import load_model

SHIPPED = Path(__file__).resolve().parents[1] / "fastforward" / "demo" / "checkpoints"

# name -> (objective, lr, steps, objective options, config changes)
B6 = {"min_block": 6, "max_block": 6}
CANDIDATES: dict[str, tuple[str, float, int, dict, dict]] = {
    # the old shipped stage, retrained the same way from the shipped SBD weights (restart to 5e-4)
    "old_recipe": ("multitf", 5e-4, 400, {"max_group": 3}, {}),
    # the LR fix alone: a low LR (the SBD stage ended its cosine near 0), the same blocks
    "lr1e-4": ("multitf", 1e-4, 400, {"max_group": 3}, {}),
    # and with the training blocks around the decoder's block (6)
    "lr1e-4_b4-8": ("multitf", 1e-4, 400, {"max_group": 3}, {"min_block": 4, "max_block": 8}),
    "lr1e-4_b6": ("multitf", 1e-4, 400, {"max_group": 3}, B6),
    # ablations of the layouts and of the schedule at the fixed recipe
    "lr1e-4_b6_systematic": ("multitf", 1e-4, 400, {"max_group": 3, "layouts": "systematic"}, B6),
    "lr1e-4_b6_random": ("multitf", 1e-4, 400, {"max_group": 3, "layouts": "random"}, B6),
    "lr1e-4_b6_d2f": ("multitf", 1e-4, 400, {"max_group": 3, "schedule": "d2f"}, B6),
    # the schedule from benchmarks/mbd_statistics.py: a group's last block often wholly masked
    "lr1e-4_b6_fresh": ("multitf", 1e-4, 400, {"max_group": 3, "schedule": "fresh-tail"}, B6),
    "lr1e-4_b6_fresh_seed1": ("multitf", 1e-4, 400, {"max_group": 3, "schedule": "fresh-tail"}, {**B6, "seed": 1}),
    "lr2e-4_b6_fresh_800": ("multitf", 2e-4, 800, {"max_group": 3, "schedule": "fresh-tail"}, B6),
    # controls: SBD continued with the same LR and steps (is any gain MultiTF's or more training's?)
    "sbd_lr1e-4": ("sbd", 1e-4, 400, {}, {}),
    "sbd_lr1e-4_b6": ("sbd", 1e-4, 400, {}, B6),
    "sbd_lr1e-4_b6_seed1": ("sbd", 1e-4, 400, {}, {**B6, "seed": 1}),
}


def train(name: str, out: Path, config: DemoConfig, steps: int | None) -> float:
    objective, lr, default_steps, options, changes = CANDIDATES[name]
    steps = steps or default_steps
    tuned = replace(config, finetune_steps=steps, finetune_lr=lr, **changes)
    started = time.perf_counter()
    finetune(tuned, out / "sbd", out / name, objective, log, **options)
    write_task_options(out / name, config)
    seconds = time.perf_counter() - started
    stage = Stage(name, "sbd", objective, steps, lr, {**options, **changes})
    write_provenance(out / name, stage, seconds, "python benchmarks/multitf_recipe.py --train " + name)
    return seconds


def decoders(s: Settings, accepts: list[float]) -> dict:
    found = {}
    for accept in accepts:
        found[f"sbd τ={accept:g}"] = build_decoder("sbd", block_size=s.small_block, policy="threshold", gamma=accept)
        found[f"mbd τ={accept:g}"] = build_decoder(
            "mbd", block_size=s.small_block, buffer_size=s.buffer_size, add_threshold=s.add_threshold,
            accept_threshold=accept,
        )  # fmt: skip
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/multitf")
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--train", default="", help=f"comma-separated candidates: {', '.join(CANDIDATES)}")
    p.add_argument(
        "--eval", default="", help="models to evaluate, comma-separated (sbd, multitf_shipped: the shipped checkpoints)"
    )
    p.add_argument("--steps", type=int, default=None, help="override every candidate's steps (smoke runs)")
    p.add_argument("--n", type=int, default=DemoConfig().eval_examples)
    p.add_argument("--accepts", default="0.9", help="accept thresholds (SingleBD's τ too)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="", help="suffix of the results file")
    args = p.parse_args()
    threads = set_threads(args.threads)
    out, config = Path(args.out), DemoConfig()
    out.mkdir(parents=True, exist_ok=True)
    for name, shipped in (("sbd", "sbd"), ("multitf_shipped", "multitf")):  # the shipped models, as they are
        if not (out / name / "config.json").exists():
            shutil.copytree(SHIPPED / shipped, out / name)
    seconds = {}
    for name in filter(None, args.train.split(",")):
        if (out / name / "config.json").exists():
            log(f"reusing {out / name}")
            continue
        seconds[f"train {name}"] = round(train(name, out, config, args.steps), 1)
        log(f"trained {name} in {seconds[f'train {name}']} s")
    names = list(filter(None, args.eval.split(",")))
    if not names:
        return
    load_before = machine_info(load=True)["load_average"]
    accepts = [float(x) for x in args.accepts.split(",")]
    task = config.task()
    examples = task.examples("test", n=args.n, seed=config.seed)
    rows, correct = [], {}
    t0 = time.perf_counter()
    for name in names:
        model = load_model(str(out / name), precision=config.precision())
        results = compare(
            model, task, decoders(Settings(), accepts), examples, max_new_tokens=config.max_new_tokens,
            chat_template=False, desc=f"eval {name}",
        )  # fmt: skip
        for label, result in results.items():
            rows.append(result_row(result, model=name, decoder=label))
            correct[f"{name}: {label}"] = [bool(r["correct"]) for r in result.records]
    seconds["evaluate"] = round(time.perf_counter() - t0, 1)
    y_max = max(r["accuracy"] for r in rows)
    aups = {}
    for name in names:
        for prefix in ("sbd τ=", "mbd τ="):
            aups[f"{name}: {prefix[:3]}"] = curve_aup(rows, prefix, y_max, name)
    checks, paired = [], {}
    base = "sbd"
    if base in names:
        for accept in accepts:
            single = next(r for r in rows if r["model"] == base and r["decoder"] == f"sbd τ={accept:g}")
            free = next(r for r in rows if r["model"] == base and r["decoder"] == f"mbd τ={accept:g}")
            for name in names:
                multi = next(r for r in rows if r["model"] == name and r["decoder"] == f"mbd τ={accept:g}")
                a, b = correct[f"{name}: mbd τ={accept:g}"], correct[f"{base}: mbd τ={accept:g}"]
                paired[f"{name} vs {base}, mbd τ={accept:g}"] = {
                    "only_this": sum(x and not y for x, y in zip(a, b, strict=True)),
                    "only_base": sum(y and not x for x, y in zip(a, b, strict=True)),
                }
                if name == base:
                    continue
                checks.append(
                    {
                        "target": f"{name}: mbd τ={accept:g} >= training-free mbd + 2 points at TPF >= 1.3 x SingleBD",
                        "mbd": multi["accuracy"],
                        "training_free": free["accuracy"],
                        "tpf_ratio": round(multi["tpf"] / single["tpf"], 3),
                        "met": multi["accuracy"] >= free["accuracy"] + 2 and multi["tpf"] >= 1.3 * single["tpf"],
                    }
                )
                checks.append(
                    {
                        "target": f"{name}: mbd τ={accept:g} TPF >= 1.3 x SingleBD (same block, τ) at >= its accuracy",
                        "mbd": [multi["accuracy"], multi["tpf"]],
                        "single": [single["accuracy"], single["tpf"]],
                        "met": multi["accuracy"] >= single["accuracy"] and multi["tpf"] >= 1.3 * single["tpf"],
                    }
                )
    print(format_table(rows, result_columns("model", "decoder", "accuracy", "tpf", "nfe_mean", "tps", "speedup")))
    print("\nAUP (one scale, y_max = best accuracy of all rows):", aups)
    print("paired (problems only one of the two solves):", paired)
    print_targets(checks, details=True)
    report = {
        "args": vars(args),
        "candidates": {n: CANDIDATES[n] for n in names if n in CANDIDATES},
        "rows": rows,
        "y_max": y_max,
        "aup": aups,
        "paired": paired,
        "checks": checks,
        "seconds": seconds,
        "threads": threads,
        "load_average_before": load_before,
        "machine": machine_info(load=True),
    }
    path = write_json(Path(args.results) / f"multitf_recipe{args.tag}.json", report)
    log(f"\nwrote {path}")


if __name__ == "__main__":
    main()
