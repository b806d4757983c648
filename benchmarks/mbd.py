"""Multi-Block Diffusion on the demo task: SingleBD vs training-free MultiBD vs MultiTF-post-trained
MultiBD, with an SBD-continued control trained for the same extra steps (the MBD-LMs paper's Table 1
shape, at CPU scale).

Models, in --out (each reused when it exists):
    pretrain/, sbd/     the demo's pipeline at a longer budget (trained here when missing)
    multitf/            sbd/ post-trained with MultiTF (layouts both, chain-uniform) for --post-steps
    sbd_more/           sbd/ trained with SBD for the same steps and LR: the control
    multitf_<variant>/  with --ablations: layouts systematic / random, schedule d2f / uniform

Every model is evaluated on the same --n held-out problems at --block-size (small enough that
answers span several blocks; their lengths in blocks are printed): AR (the wall-clock baseline of
the same run), SingleBD (`sbd` with the threshold policy at each accept threshold τ: one block at a
time, the same acceptance rule as a buffer of one) and MultiBD (`mbd`, buffer --buffer-size) over
the add × accept grid, plus `mbd --static` at the first grid point (wall clock of the fixed-shape
mode; its tokens equal the dynamic mode's). AUP is computed over each decoder's accept sweep.

Target (the paper's shape): MultiTF MultiBD TPF >= 1.5 x SingleBD's at accuracy no lower than
SingleBD's, and better AUP than training-free MultiBD.

    python benchmarks/mbd.py                                   # everything, about an hour on 2 cores
    python benchmarks/mbd.py --out runs/zoo --post-steps 400 --n 150 --threads 2

Writes benchmarks/results/mbd.json (or --results DIR).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from common import (
    base_stages,
    curve_aup,
    machine_info,
    print_targets,
    result_columns,
    result_row,
    train_zoo,
    zoo_arguments,
)

from fastforward.api import build_decoder
from fastforward.demo.pipeline import DemoConfig
from fastforward.demo.zoo import Stage
from fastforward.evaluation.evaluate import AR, compare
from fastforward.evaluation.report import format_table, write_json
from fastforward.model import load_model

ABLATIONS = {
    "multitf_systematic": {"layouts": "systematic"},
    "multitf_random": {"layouts": "random"},
    "multitf_d2f": {"schedule": "d2f"},
    "multitf_uniform": {"schedule": "uniform"},
}


def stages(args: argparse.Namespace, config: DemoConfig) -> list[Stage]:
    """The base pipeline, the MultiTF and SBD-continued post-training runs, and the ablations."""
    group = {"max_group": args.max_group}
    post = [
        Stage("multitf", "sbd", "multitf", args.post_steps, args.post_lr, group),
        Stage("sbd_more", "sbd", "sbd", args.post_steps, args.post_lr),
    ]
    if args.ablations:
        post += [
            Stage(n, "sbd", "multitf", args.post_steps, args.post_lr, {**group, **o}) for n, o in ABLATIONS.items()
        ]
    return [*base_stages(args, config), *post]


def decoders(args: argparse.Namespace) -> dict[str, object]:
    """SingleBD at each accept threshold, MultiBD over add × accept, and the static mode once."""
    found: dict[str, object] = {}
    for accept in args.accepts:
        found[f"sbd τ={accept:g}"] = build_decoder("sbd", block_size=args.block_size, policy="threshold", gamma=accept)
    for add in args.adds:
        for accept in args.accepts:
            found[f"mbd add={add:g} τ={accept:g}"] = build_decoder(
                "mbd", block_size=args.block_size, buffer_size=args.buffer_size, add_threshold=add,
                accept_threshold=accept, semi_threshold=args.semi,
            )  # fmt: skip
    add, accept = args.adds[0], args.accepts[0]
    found[f"mbd --static add={add:g} τ={accept:g}"] = build_decoder(
        "mbd", block_size=args.block_size, buffer_size=args.buffer_size, add_threshold=add,
        accept_threshold=accept, semi_threshold=args.semi, static=True,
    )  # fmt: skip
    return found


def summarize(rows: list[dict], args: argparse.Namespace) -> dict:
    """AUP per (model, decoder setting) on one scale, and the paper's target checks."""
    y_max = max(r["accuracy"] for r in rows)
    aups = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        aups[f"{model}: sbd"] = curve_aup(rows, "sbd τ=", y_max, model)
        for add in args.adds:
            aups[f"{model}: mbd add={add:g}"] = curve_aup(rows, f"mbd add={add:g} ", y_max, model)

    def best(model: str, prefix: str, floor: float) -> dict | None:
        """The highest-TPF row of `model` whose label starts with `prefix` and accuracy >= floor."""
        fits = [r for r in rows if r["model"] == model and r["decoder"].startswith(prefix) and r["accuracy"] >= floor]
        return max(fits, key=lambda r: r["tpf"], default=None)

    checks = []
    for accept in args.accepts:
        single = next(r for r in rows if r["model"] == "sbd" and r["decoder"] == f"sbd τ={accept:g}")
        multi = best("multitf", "mbd add=", single["accuracy"])
        checks.append(
            {
                "target": f"MultiTF MultiBD TPF >= 1.5 x SingleBD (τ={accept:g}) at accuracy >= SingleBD's",
                "single": single,
                "multitf_mbd": multi,
                "ratio": None if multi is None else round(multi["tpf"] / single["tpf"], 3),
                "met": multi is not None and multi["tpf"] >= 1.5 * single["tpf"],
            }
        )
    for add in args.adds:
        trained, free = aups[f"multitf: mbd add={add:g}"], aups[f"sbd: mbd add={add:g}"]
        checks.append(
            {
                "target": f"MultiTF MultiBD AUP > training-free MultiBD AUP (add={add:g})",
                "multitf": trained,
                "training_free": free,
                "met": trained is not None and free is not None and trained > free,
            }
        )
    return {"y_max": y_max, "aup": aups, "checks": checks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo_arguments(p, "runs/mbd", "mbd.json", "SBD fine-tune steps when sbd/ is missing")
    p.add_argument("--post-steps", type=int, default=400, help="MultiTF post-training steps (and the control's)")
    p.add_argument("--post-lr", type=float, default=5e-4, help="peak LR of the post-training runs")
    p.add_argument("--max-group", type=int, default=3, help="MultiTF's largest noise-group (blocks)")
    p.add_argument("--ablations", action="store_true", help="also train and evaluate the four MultiTF ablations")
    p.add_argument("--block-size", type=int, default=6)
    p.add_argument("--buffer-size", type=int, default=3)
    p.add_argument("--adds", default="0.1,0.5", help="add thresholds of the MultiBD grid")
    p.add_argument("--accepts", default="0.9,0.7,0.5", help="accept thresholds (SingleBD's τ too)")
    p.add_argument("--semi", type=float, default=0.9, help="semi-complete threshold")
    args = p.parse_args()
    args.adds = [float(x) for x in args.adds.split(",")]
    args.accepts = [float(x) for x in args.accepts.split(",")]

    started = time.perf_counter()
    config, out, threads, seconds = train_zoo(args, stages)

    task = config.task()
    examples = task.examples("test", n=config.eval_examples, seed=config.seed)
    models = ["sbd", "multitf", "sbd_more", *(ABLATIONS if args.ablations else [])]
    rows: list[dict] = []
    lengths: list[int] = []
    t0 = time.perf_counter()
    for name in models:
        model = load_model(str(out / name))
        results = compare(
            model, task, decoders(args), examples, max_new_tokens=config.max_new_tokens, chat_template=False,
            desc=f"eval {name}",
        )  # fmt: skip
        rows += [result_row(result, model=name, decoder=label) for label, result in results.items()]
        if name == "sbd":
            lengths = [r["tokens"] for r in results[AR].records]
    seconds["evaluate"] = round(time.perf_counter() - t0, 1)
    seconds["total"] = round(time.perf_counter() - started, 1)

    blocks = [math.ceil(n / args.block_size) for n in lengths]
    answer = {
        "tokens_mean": round(statistics.mean(lengths), 1),
        "blocks_mean": round(statistics.mean(blocks), 2),
        "blocks_min": min(blocks),
        "blocks_max": max(blocks),
    }
    summary = summarize(rows, args)
    columns = result_columns("model", "decoder", "accuracy", "tpf", "nfe_mean", "tps", "speedup")
    print(format_table(rows, columns))
    print(f"\nAR answers (sbd model): {answer} at block size {args.block_size}")
    print("\nAUP (one scale, y_max = best accuracy of all rows):")
    for key, value in summary["aup"].items():
        print(f"  {key}: {value}")
    print_targets(summary["checks"])
    report = {
        "args": {k: v for k, v in vars(args).items()},
        "rows": rows,
        "answer_lengths": answer,
        **summary,
        "seconds": seconds,
        "threads": threads,
        "machine": machine_info(load=True),
    }
    path = write_json(Path(args.results) / "mbd.json", report)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
