"""The data of the shared SFT start every seed method's arithmetic model begins from (issue 81, item 0).

A start that reads people's phrasing: the `arithmetic` task's train split in its varied wording
(`phrasing=varied`: everyday stories, facts said many ways, distractors, numbers in words) in the range
the presets are measured in (2-3 operations, numbers to 20, factors to 5), mixed with GSM8K's short train
problems (at most three solution lines, questions of at most 260 characters whose numbers are at most
100, whole answers to 500), which people wrote. The recipes that train from this start take the same
problems (`--task arithmetic --problems 4000 --task-option ...`, this file's RANGE and phrasing=varied) and
hold out their dev split (`--dev 100 --seed 0`): this data leaves those problems out, so every method's dev
curve reads problems its start never saw. GSM8K is read from a path (openai/grade-school-math at
3101c7d, `grade_school_math/data/train.jsonl`, sha256 17f347dc…3813465); its test split is not read.

    python benchmarks/arithmetic_start_data.py --gsm8k PATH/train.jsonl --out runs/start/data.jsonl
    fastforward train --objective ntp --data runs/start/data.jsonl --out runs/start/sft ...
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from fastforward.recipes.records import TaskData, split_dev, strip_calculator_marks

RANGE = {"min_ops": 2, "max_ops": 3, "max_number": 20, "max_factor": 5}
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def short_gsm8k(path: Path) -> list[dict[str, str]]:
    """GSM8K train problems a small model can learn from (few steps, small whole numbers), as
    `fastforward train` reads them: prompt and completion."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        solution, answer = record["answer"].split("####")
        steps = solution.strip().splitlines()
        numbers = [float(n.replace(",", "")) for n in _NUMBER.findall(record["question"])]
        answer = answer.strip().replace(",", "")
        small = numbers and max(numbers) <= 100 and answer.isdigit() and int(answer) <= 500
        if small and len(steps) <= 3 and len(record["question"]) <= 260:
            completion = strip_calculator_marks(solution).strip() + f"\n#### {answer}"
            out.append({"prompt": record["question"].strip() + "\n", "completion": completion})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gsm8k", type=Path, required=True, help="GSM8K's train.jsonl")
    parser.add_argument("--problems", type=int, default=4000, help="varied arithmetic train problems")
    parser.add_argument("--dev", type=int, default=100, help="the recipes' --dev: those problems are left out")
    parser.add_argument("--seed", type=int, default=0, help="the recipes' --seed (of their dev split)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    options = tuple((k, str(v)) for k, v in {**RANGE, "phrasing": "varied"}.items())
    data = TaskData("arithmetic", args.problems, options)  # the records a recipe's --task gives
    train, _ = split_dev(data.records(), args.dev, args.seed)  # the recipes' dev split is never trained on
    records = [{"prompt": r.prompt, "completion": r.completion} for r in train]
    gsm8k = short_gsm8k(args.gsm8k)
    mixed = records + gsm8k
    random.Random(args.seed).shuffle(mixed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    print(f"{len(records)} varied arithmetic (the dev split left out) + {len(gsm8k)} short GSM8K -> {args.out}")


if __name__ == "__main__":
    main()
