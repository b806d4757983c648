"""A recipe run's model at one point of its learning curve, before the run ends: its final dev rows (the
recipe's own decoders) on the first --n dev records, interleaved, at `generate`'s precision (int4 `--exact`),
batch 1, greedy. For a look at a long training while it runs; the recipe's own dev stage measures every curve
point when training is done. Tokens/s are only as good as the machine is quiet (the training shares it), so
read TPF, accuracy and "= own ar" first.

    python benchmarks/recipe_snapshot.py --work runs/sbd-arith --step 53 --n 20 --threads 1

Prints one table and writes benchmarks/results/recipe_snapshot-<work>-<step>.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import RESULTS, load_average, log, set_threads, write_report

from fastforward.model import load_model
from fastforward.recipes.dev_eval import table
from fastforward.recipes.pipeline import SERVED, reopen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="a recipe run's work folder (running or finished)")
    p.add_argument("--step", type=int, required=True, help="a curve snapshot's step (WORK/curve/step-N)")
    p.add_argument("--n", type=int, default=20, help="dev records (the first n)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    threads, before = set_threads(args.threads), load_average()
    recipe = reopen(args.work, log=log)
    snapshot = args.work / "curve" / f"step-{args.step:05d}"
    if not snapshot.exists():
        found = sorted(s.name for s in (args.work / "curve").glob("step-*"))
        raise SystemExit(f"no snapshot {snapshot}; there are: {', '.join(found) or 'none yet'}")
    model = load_model(str(snapshot), **SERVED)
    records = recipe.dev_records[: args.n]
    prompts = [model.encode_prompt(r.prompt) for r in records]
    contenders = {label: (model, name, options) for label, (name, options) in recipe.final_decoders().items()}
    log(f"{snapshot} on {len(records)} dev records: {', '.join(contenders)} interleaved")
    rows = table(contenders, records, prompts, args.max_new_tokens)
    log("\n| decoder | accuracy | TPF | tokens/s | × own ar | = own ar |")
    log("|---|---|---|---|---|---|")
    for label, row in rows.items():
        equal = f"{row['equal_ar']} of {row['n']}" if "equal_ar" in row else ""
        accuracy = f"{row['accuracy']:.1%}" if "accuracy" in row else ""
        ratio = row["tps"] / rows["ar"]["tps"]
        log(f"| {label} | {accuracy} | {row['tpf']:.2f} | {row['tps']:.1f} | {ratio:.2f} | {equal} |")
    out = RESULTS / f"recipe_snapshot-{args.work.name}-{args.step}.json"
    write_report(out, before, threads, work=str(args.work), step=args.step, n=len(records), rows=rows)


if __name__ == "__main__":
    main()
