"""The table of `benchmarks/lora_layers_quality.sh`: every layer against the top N at an equal token budget.

For each method (its two work folders, `layers0` and `layers10`), from what the recipes recorded: the method
stage's tokens and tokens/s, its last training losses, and on the dev split (int4 `--exact`, batch 1, greedy)
`ar`'s accuracy and the method's rows' TPF and accuracy. The noise of the dev split: a paired bootstrap over its
prompts (both models answered the same ones) of the difference top N − every layer, 95 % interval.

    python benchmarks/lora_layers_quality.py                      # runs/lora-layers
    python benchmarks/lora_layers_quality.py --runs runs/lora-layers --layers 10
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from common import RESULTS, log, write_report

STAGES = {"jacobi-forcing": "jf", "sbd": "sbd"}  # each recipe's training folder
DRAWS = 2000


def training(work: Path, stage: str) -> dict:
    """The method stage's tokens, steps, median tokens/s and mean loss of its last five steps."""
    rows = [json.loads(line) for line in (work / stage / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    return {
        "steps": len(train),
        "tokens": sum(r["tokens"] for r in train),
        "hours": sum(r["tokens"] / r["tokens_per_s"] for r in train) / 3600,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[1:] or train),
        "last_loss": statistics.mean(r["loss"] for r in train[-5:]),
    }


def interval(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [round(ordered[int(0.025 * len(ordered))], 4), round(ordered[int(0.975 * len(ordered)) - 1], 4)]


def paired(a: dict, b: dict, rng: random.Random) -> dict:
    """Top N − every layer on the same prompts: accuracy and TPF, each with a bootstrap interval."""
    pa, pb = a["prompts"], b["prompts"]
    n = len(pa["tokens"])
    tpf = lambda p, idx: sum(p["tokens"][i] for i in idx) / max(sum(p["nfe"][i] for i in idx), 1)  # noqa: E731
    acc = lambda p, idx: sum(p["correct"][i] for i in idx) / len(idx)  # noqa: E731
    draws = [[rng.randrange(n) for _ in range(n)] for _ in range(DRAWS)]
    everyone = list(range(n))
    out = {"tpf": round(tpf(pb, everyone) - tpf(pa, everyone), 4)}
    out["tpf_95"] = interval([tpf(pb, d) - tpf(pa, d) for d in draws])
    if "correct" in pa:
        out["accuracy"] = round(acc(pb, everyone) - acc(pa, everyone), 4)
        out["accuracy_95"] = interval([acc(pb, d) - acc(pa, d) for d in draws])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=Path("runs/lora-layers"))
    p.add_argument("--layers", type=int, default=10, help="the top-N runs to set against every layer")
    p.add_argument("--out", type=Path, default=RESULTS / "lora_layers_quality.json")
    args = p.parse_args()
    rng = random.Random(0)
    report = {}
    for method, stage in STAGES.items():
        works = {layers: args.runs / f"{method}-layers{layers}" for layers in (0, args.layers)}
        if not all((w / "dev.json").exists() for w in works.values()):
            log(f"{method}: not finished (no dev.json in {', '.join(map(str, works.values()))})")
            continue
        dev = {layers: json.loads((w / "dev.json").read_text())["final"] for layers, w in works.items()}
        report[method] = {"runs": {}, "differences": {}}
        for layers, work in works.items():
            row = {"training": training(work, stage)}
            for label, measured in dev[layers].items():
                row[label] = {k: measured[k] for k in ("n", "tpf", "tps", "accuracy", "equal_ar") if k in measured}
            report[method]["runs"][f"layers{layers}"] = row
            t = row["training"]
            log(f"{method} {'every layer' if not layers else f'top {layers}'}: {t['tokens']:,.0f} tokens in "
                f"{t['hours']:.2f} h ({t['tokens_per_s']:.0f} tokens/s), last loss {t['last_loss']:.3f}; dev: "
                + "; ".join(f"{label} acc {m.get('accuracy', 0):.3f} TPF {m['tpf']:.2f}" for label, m in row.items()
                            if label != "training"))  # fmt: skip
        for label in dev[0]:
            if "prompts" in dev[0][label] and "prompts" in dev[args.layers].get(label, {}):
                diff = paired(dev[0][label], dev[args.layers][label], rng)
                report[method]["differences"][label] = diff
                log(f"  {label}: top {args.layers} − every layer: {json.dumps(diff)}")
    write_report(args.out, None, None, runs=str(args.runs), layers=args.layers, report=report)


if __name__ == "__main__":
    main()
