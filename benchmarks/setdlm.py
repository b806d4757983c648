"""Set Diffusion (SW-SetDLM) against SBD (block diffusion) on the demo task, at the same budget,
and infilling against AR and SBD from the prefix alone (the Set Diffusion paper's Table 1 shape, at
CPU scale).

Models, in --out (each reused when it exists; `benchmarks/mbd.py` trains pretrain/ and sbd/ the
same way):
    pretrain/       the demo's NTP-pretrained model
    sbd/            pretrain/ fine-tuned with SBD for --finetune-steps
    setdlm/         pretrain/ fine-tuned with SetDLM for the same steps (NTP weight 1, the default)
    setdlm_no_ntp/  the same without the NTP term (with --ntp-ablation): does the NTP term help?

1. Arithmetic (--n held-out problems): the SBD model with `sbd` over the demo's γ sweep, the
   SetDLM model with `setdlm` over the window × threshold grid; AR of each model in the same run
   (wall-clock baseline); AUP of each curve on one scale. Target: SW-SetDLM's AUP above SBD's.
2. Infilling (`arithmetic-infill`, the same problems with a calculation line hidden): `setdlm`
   (suffix up front and promoted) against AR and `sbd` continuing the prefix alone, on the SBD
   model (whose AR is a full-strength NTP model) and on the SetDLM model. Target: SW-SetDLM's exact
   match and ROUGE-L above both, at a higher TPS than AR.

    python benchmarks/setdlm.py --out runs/zoo --threads 2            # trains what is missing
    python benchmarks/setdlm.py --out /tmp/s --pretrain-steps 3 --finetune-steps 3 --n 3 --threads 1  # smoke

Writes benchmarks/results/setdlm.json (or --results DIR).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import (
    base_stages,
    curve_aup,
    machine_info,
    print_targets,
    result_columns,
    result_row,
    task_shape,
    train_zoo,
    zoo_arguments,
)

from fastforward.api import build_decoder
from fastforward.demo.pipeline import DemoConfig
from fastforward.demo.zoo import Stage
from fastforward.evaluation.evaluate import compare
from fastforward.evaluation.report import format_table, write_json
from fastforward.evaluation.results import EvalResult
from fastforward.model import load_model
from fastforward.tasks import get_task


def stages(args: argparse.Namespace, config: DemoConfig) -> list[Stage]:
    """Pretrain, then SBD and SetDLM (and its no-NTP ablation) fine-tunes of the same length."""
    orders = {"set_size": args.set_size, "max_set": args.max_set}
    ablation = [Stage("setdlm_no_ntp", "pretrain", "setdlm", args.finetune_steps, config.finetune_lr, orders, 0.0)]
    return [
        *base_stages(args, config),
        Stage("setdlm", "pretrain", "setdlm", args.finetune_steps, config.finetune_lr, orders),
        *(ablation if args.ntp_ablation else []),
    ]


def row(part: str, model: str, label: str, result: EvalResult) -> dict:
    return {**result_row(result, part=part, model=model, decoder=label), "rouge_l": round(100 * result.score, 2)}


def setdlm_grid(args: argparse.Namespace, **extra) -> dict:
    return {
        f"setdlm w={w} p={p:g}": build_decoder("setdlm", window=w, threshold=p, **extra)
        for w in args.windows
        for p in args.thresholds
    }


def main() -> None:
    d = DemoConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo_arguments(p, "runs/setdlm", "setdlm.json", "fine-tune steps of both methods")
    p.add_argument("--set-size", type=float, default=4.0)
    p.add_argument("--max-set", type=float, default=8.0)
    p.add_argument("--ntp-ablation", action="store_true", help="also train and evaluate SetDLM without the NTP term")
    p.add_argument("--windows", default="2,4,8")
    p.add_argument("--thresholds", default="0.9,0.7,0.5")
    p.add_argument("--gammas", default=",".join(f"{g:g}" for g in d.gammas), help="SBD's γ sweep")
    args = p.parse_args()
    args.windows = [int(x) for x in args.windows.split(",")]
    args.thresholds = [float(x) for x in args.thresholds.split(",")]
    gammas = [float(x) for x in args.gammas.split(",")]

    started = time.perf_counter()
    config, out, threads, seconds = train_zoo(args, stages)
    options = dict(max_new_tokens=config.max_new_tokens, chat_template=False, progress=False)
    t0 = time.perf_counter()

    # 1. arithmetic: SBD's γ sweep vs SetDLM's window × threshold grid
    task = config.task()
    examples = task.examples("test", n=args.n, seed=config.seed)
    sbd_model = load_model(str(out / "sbd"))
    sbd = {
        f"sbd γ={g:g}": build_decoder("sbd", block_size=config.block_size, policy=config.policy, gamma=g)
        for g in gammas
    }
    rows = [row("arithmetic", "sbd", k, v) for k, v in compare(sbd_model, task, sbd, examples, **options).items()]
    setdlm_models = ["setdlm", *(["setdlm_no_ntp"] if args.ntp_ablation else [])]
    for name in setdlm_models:
        model = load_model(str(out / name))
        results = compare(model, task, setdlm_grid(args), examples, **options)
        rows += [row("arithmetic", name, k, v) for k, v in results.items()]
    y_max = max(r["accuracy"] for r in rows)
    curves = {"sbd": "sbd γ=", **{name: "setdlm w=" for name in setdlm_models}}
    aups = {name: curve_aup(rows, prefix, y_max, name) for name, prefix in curves.items()}

    # 2. infilling: setdlm (both suffix modes) vs AR and sbd from the prefix alone
    shape = task_shape(config)
    infill_task = get_task("arithmetic-infill", **shape)
    infill_examples = infill_task.examples("test", n=args.n, seed=config.seed)
    sbd_from_prefix = {"sbd γ=0.1 (prefix only)": build_decoder("sbd", block_size=config.block_size, gamma=0.1)}
    results = compare(sbd_model, infill_task, sbd_from_prefix, infill_examples, **options)
    rows += [row("infill", "sbd", k, v) for k, v in results.items()]
    infillers = {
        f"setdlm w=4 p=0.9 suffix {mode}": build_decoder("setdlm", window=4, threshold=0.9, suffix_cache=mode)
        for mode in ("upfront", "promote")
    }
    for name in setdlm_models:
        results = compare(load_model(str(out / name)), infill_task, infillers, infill_examples, **options)
        rows += [row("infill", name, k, v) for k, v in results.items()]
    seconds["evaluate"] = round(time.perf_counter() - t0, 1)
    seconds["total"] = round(time.perf_counter() - started, 1)

    columns = result_columns("part", "model", "decoder", "exact", "rouge_l", "tpf", "tps", "speedup")
    print(format_table(rows, columns))
    print(f"\nAUP on arithmetic (y_max {y_max}): {aups}")
    infill = [r for r in rows if r["part"] == "infill"]
    best = max((r for r in infill if r["decoder"].startswith("setdlm")), key=lambda r: r["accuracy"])
    baselines = [r for r in infill if not r["decoder"].startswith("setdlm")]
    ar_tps = max(r["tps"] for r in baselines if r["decoder"] == "ar")
    above = all(best[k] > r[k] for r in baselines for k in ("accuracy", "rouge_l"))
    checks = [
        {"target": "SW-SetDLM AUP > SBD AUP (arithmetic)", "met": aups["setdlm"] > aups["sbd"]},
        {
            "target": "SW-SetDLM infill exact match and ROUGE-L above AR and SBD from the prefix, TPS above AR",
            "best_setdlm": best,
            "met": above and best["tps"] > ar_tps,
        },
    ]
    print_targets(checks)
    report = {
        "args": vars(args),
        "rows": rows,
        "aup": aups,
        "checks": checks,
        "seconds": seconds,
        "threads": threads,
        "machine": machine_info(load=True),
    }
    print(f"\nwrote {write_json(Path(args.results) / 'setdlm.json', report)}")


if __name__ == "__main__":
    main()
