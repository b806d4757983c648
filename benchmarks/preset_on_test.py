"""A model at its own decoding defaults on a held-out test split, as a user asks it: against its own `ar` and
`lookup`, the base model's `ar`, and (optionally) an NTP control's `ar`, interleaved prompt by prompt.

Every contender runs at `generate`'s defaults (int4 `--exact`, greedy, batch 1, the chat template, 2 threads
unless `--threads`), on the same prompts in the same process, so ratios are taken within one run. The
model's "defaults" row is what `fastforward generate --model MODEL PROMPT` runs with no decoder flags (its
`decoding.json`); each lossless row is compared with the model's own `ar` token for token.

    python benchmarks/preset_on_test.py --model smollm2-135m-jf-arithmetic --task arithmetic --n 300
    python benchmarks/preset_on_test.py --model smollm2-135m-jf-gsm8k --data gsm8k/test.jsonl --n 500 \\
        --control runs/jf-gsm8k/control

Prints one table and writes benchmarks/results/preset_on_test-<model>.json (machine, load, each row).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import RESULTS, held_out_records, load_average, log, set_threads, write_report

from fastforward.decoding.model_defaults import model_decoding_defaults
from fastforward.model import load_model
from fastforward.recipes.dev_eval import table

BASE = "smollm2-135m"
SERVED = {"quantize": "int4", "exact": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a preset or model folder with its decoding.json")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="a test JSONL (GSM8K lines, or prompt/answer)")
    source.add_argument("--task", choices=["arithmetic"], help="the arithmetic preset's own test split")
    p.add_argument("--n", type=int, default=500, help="test records (the first n)")
    p.add_argument(
        "--clean", action="store_true", help="--task arithmetic: only test problems apart from the train problems"
    )
    p.add_argument("--control", help="an NTP control model whose ar accuracy is measured beside")
    p.add_argument("--no-base", action="store_true", help="leave out the base model's ar")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    threads, before = set_threads(args.threads), load_average()
    records = held_out_records(args.data, args.n, args.clean)
    defaults = model_decoding_defaults(args.model)
    if defaults is None:
        raise SystemExit(f"{args.model} has no decoding.json: nothing to measure its defaults by")
    model = load_model(args.model, **SERVED)
    prompts = [model.encode_prompt(r.prompt) for r in records]
    contenders = {"ar": (model, "ar", {}), "lookup": (model, "lookup", {})}
    contenders[f"defaults ({defaults.describe()})"] = (model, defaults.decoder, dict(defaults.options))
    if not args.no_base:
        contenders["base ar"] = (load_model(BASE, **SERVED), "ar", {})
    if args.control:
        contenders["control ar"] = (load_model(args.control, **SERVED), "ar", {})
    log(f"{args.model} on {len(records)} test records: {', '.join(contenders)} interleaved")
    rows = table(contenders, records, prompts, args.max_new_tokens)
    own_ar, own_lookup = rows["ar"]["tps"], rows["lookup"]["tps"]
    log("\n| contender | accuracy | TPF | tokens/s | × its ar | × its lookup | = its ar |")
    log("|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        own = not label.startswith(("base", "control"))
        ratios = f"{row['tps'] / own_ar:.2f} | {row['tps'] / own_lookup:.2f}" if own else " | "
        equal = f"{row['equal_ar']} of {row['n']}" if own and "equal_ar" in row else ""
        accuracy = f"{row['accuracy']:.1%}" if "accuracy" in row else ""
        log(f"| {label} | {accuracy} | {row['tpf']:.2f} | {row['tps']:.1f} | {ratios} | {equal} |")
    out = RESULTS / f"preset_on_test-{Path(args.model).name}{'-clean' if args.clean else ''}.json"
    write_report(out, before, threads, model=args.model, n=len(records), defaults=defaults.as_json(), rows=rows)


if __name__ == "__main__":
    main()
