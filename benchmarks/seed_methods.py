"""The seed methods side by side on one base, one data set and one budget: each recipe run's model on held-out
problems with its method's rows, against its own `ar`, beside the base's and the NTP control's `ar`.

    python benchmarks/seed_methods.py --work runs/sbd-arith runs/mtf-arith runs/setdlm-arith \\
        --preset smollm2-135m-jf-arithmetic \\
        --control runs/sbd-arith/control --task arithmetic --clean --n 300

Each --work is a finished recipe run (`fastforward recipe NAME ... --work DIR`; its plan names the method);
its rows are the recipe's final dev rows, measured here on the test records at `generate`'s precision (int4
`--exact`), batch 1, greedy, interleaved prompt by prompt within each model (ratios are to that model's own
`ar` in the same pass). Training tokens and minutes are read from the run's metrics (its own stages; a
MultiTF run says which model it started from). Prints one markdown table, writes
benchmarks/results/seed_methods.json and a plot of accuracy against tokens/s, one colour per method.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import RESULTS, held_out_records, load_average, log, set_threads, write_report

from fastforward.decoding.model_defaults import model_decoding_defaults
from fastforward.evaluation.plots import Mark, plot_methods
from fastforward.model import load_model
from fastforward.model.presets import resolve_model_path
from fastforward.recipes.dev_eval import table
from fastforward.recipes.pipeline import SERVED, Recipe, reopen
from fastforward.training.run_dir import METRICS


def training(recipe: Recipe) -> dict:
    """Tokens the run's stages read and the minutes they trained (its SFT and its method's stage)."""
    tokens = seconds = 0.0
    for stage in ("sft", recipe.stage):
        path = recipe.work / stage / METRICS
        for line in path.read_text().splitlines() if path.exists() else []:
            entry = json.loads(line)
            if entry.get("split") == "train":
                tokens += entry["tokens"]
                seconds += entry["tokens"] / entry["tokens_per_s"]
    start = getattr(recipe.options, "start", "")
    size = sum(f.stat().st_size for f in recipe.flattened().glob("*.safetensors"))
    return {"tokens": tokens, "minutes": seconds / 60, "adapter_mb": size / 1e6, **({"from": start} if start else {})}


def preset_base(name: str) -> str:
    """The base a shipped adapter is over (its provenance's `base`), or the name itself for a whole model."""
    provenance = resolve_model_path(name) / "provenance.json"
    return json.loads(provenance.read_text()).get("base", name) if provenance.exists() else name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", nargs="+", type=Path, default=[], help="finished recipe runs (work folders)")
    p.add_argument(
        "--preset",
        nargs="+",
        default=[],
        help="shipped models made otherwise (e.g. smollm2-135m-jf-arithmetic): "
        "their ar, lookup and decoding defaults; their training as their provenance.json says",
    )
    p.add_argument("--control", help="an NTP control model (e.g. a run's WORK/control) whose ar is measured")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="a test JSONL (GSM8K lines, or prompt/answer)")
    source.add_argument("--task", choices=["arithmetic"], help="the arithmetic presets' own test split")
    p.add_argument("--clean", action="store_true", help="--task arithmetic: only problems apart from the train ones")
    p.add_argument("--n", type=int, default=300, help="test records (the first n)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "seed_methods.json")
    args = p.parse_args()
    threads, before = set_threads(args.threads), load_average()
    records = held_out_records(args.data, args.n, args.clean)
    recipes = [reopen(work, log=log) for work in args.work]
    if not recipes and not args.preset:
        raise SystemExit("nothing to compare: give --work folders and/or --preset models")
    bases = {recipe.options.model for recipe in recipes} | {preset_base(name) for name in args.preset}
    if len(bases) > 1:
        raise SystemExit(f"the runs start from different bases ({', '.join(sorted(bases))}): compare one base")
    base = load_model(bases.pop(), **SERVED)
    prompts = [base.encode_prompt(r.prompt) for r in records]
    methods: dict[str, dict] = {}
    for recipe in recipes:
        label = f"{recipe.name} ({recipe.work.name})"
        model = load_model(str(recipe.flattened()), **SERVED)
        contenders = {row: (model, name, options) for row, (name, options) in recipe.final_decoders().items()}
        log(f"{label}: {', '.join(contenders)} on {len(records)} records, interleaved")
        rows = table(contenders, records, prompts, args.max_new_tokens)
        decoders = {row: name for row, (name, _) in recipe.final_decoders().items()}
        methods[label] = {"training": training(recipe), "decoders": decoders, "rows": rows}
    for name in args.preset:
        model, defaults = load_model(name, **SERVED), model_decoding_defaults(name)
        decoders = {"ar": ("ar", {}), "lookup": ("lookup", {})}
        if defaults is not None and defaults.decoder not in ("ar", "lookup"):
            decoders[defaults.describe()] = (defaults.decoder, dict(defaults.options))
        log(f"{name}: {', '.join(decoders)} on {len(records)} records, interleaved")
        rows = table({row: (model, d, o) for row, (d, o) in decoders.items()}, records, prompts, args.max_new_tokens)
        size = sum(f.stat().st_size for f in resolve_model_path(name).glob("*.safetensors"))
        trained = {"adapter_mb": size / 1e6}  # its training: its provenance.json
        methods[name] = {"training": trained, "decoders": {k: d for k, (d, _) in decoders.items()}, "rows": rows}
    baselines = {"base": (base, "ar", {})}
    if args.control:
        baselines["control"] = (load_model(args.control, **SERVED), "ar", {})
    log(f"{', '.join(baselines)} ar on {len(records)} records")
    rows = table({"ar": baselines.pop("base"), **{k: (m, n, o) for k, (m, n, o) in baselines.items()}}, records,
                 prompts, args.max_new_tokens)  # fmt: skip
    others = {"base": rows.pop("ar"), **rows}

    log("\n| method | decoder | accuracy | TPF | tokens/s | × own ar | = own ar | trained | adapter |")
    log("|---|---|---|---|---|---|---|---|---|")
    marks = []
    for label, method in methods.items():
        own, t = method["rows"]["ar"], method["training"]
        trained = f"{t['tokens'] / 1e6:.2f}M tokens, {t['minutes']:.0f} min" if "tokens" in t else "its provenance"
        trained += f" from {t['from']}" if "from" in t else ""
        for row_label, row in method["rows"].items():
            equal = f"{row['equal_ar']} of {row['n']}" if "equal_ar" in row else ""
            accuracy = row.get("accuracy", float("nan"))
            log(
                f"| {label} | {row_label} | {accuracy:.1%} | {row['tpf']:.2f} | {row['tps']:.1f} | "
                f"{row['tps'] / own['tps']:.2f} | {equal} | {trained} | {t['adapter_mb']:.1f} MB |"
            )
            decoder = method["decoders"][row_label]
            marks.append(Mark(label, decoder, row_label, row["tps"], 100 * accuracy))
    for label, row in others.items():
        log(f"| {label} | ar | {row.get('accuracy', float('nan')):.1%} | {row['tpf']:.2f} | {row['tps']:.1f} | | | | |")
    plot = args.out.with_suffix(".png")
    plot_methods(plot, marks, "accuracy vs tokens/s, one colour per method", "tokens/s (int4 --exact, batch 1)")
    log(f"wrote {plot}")
    write_report(args.out, before, threads, n=len(records), methods=methods, baselines=others)


if __name__ == "__main__":
    main()
