"""Greedy agreement of quantized runs with a reference run, from `fastforward eval --out` records.

For each run directory after the first (the reference), over the examples both share: how many
AR outputs are identical to the reference's, the mean share of the reference's tokens matched
before the first difference, and both accuracies.

    for q in none int8 int4; do
      fastforward eval --model smollm2-135m --task pycode --n 50 --no-chat-template --decoder lookup \
          --quantize $q $( [ $q != none ] && echo --exact ) --threads 2 --out runs/quality/$q
    done
    python benchmarks/agreement.py runs/quality/none runs/quality/int8 runs/quality/int4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ar_records(run: Path) -> dict[str, dict]:
    lines = (run / "records.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines) if r["label"] == "ar"}


def leading_share(output: list[int], reference: list[int]) -> float:
    same = next((i for i, (a, b) in enumerate(zip(output, reference, strict=False)) if a != b), None)
    return (min(len(output), len(reference)) if same is None else same) / max(len(reference), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="eval --out directories; the first is the reference")
    args = parser.parse_args()
    reference = ar_records(args.runs[0])
    for run in args.runs[1:]:
        other = ar_records(run)
        shared = [i for i in reference if i in other]
        identical = sum(other[i]["token_ids"] == reference[i]["token_ids"] for i in shared)
        leading = sum(leading_share(other[i]["token_ids"], reference[i]["token_ids"]) for i in shared) / len(shared)
        accuracy = 100 * sum(other[i]["correct"] for i in shared) / len(shared)
        base = 100 * sum(reference[i]["correct"] for i in shared) / len(shared)
        print(
            f"{run}: {identical}/{len(shared)} AR outputs identical to {args.runs[0]}'s, "
            f"mean leading agreement {leading:.3f}, accuracy {accuracy:.1f} % vs {base:.1f} %"
        )


if __name__ == "__main__":
    main()
