"""Models on grade-school questions written by hand, asked as a user would (issue 81's phrasing check).

The arithmetic models are trained on the `arithmetic` task's generated problems; this asks them questions
people wrote, in the same range (2-3 operations, numbers to 20, factors to 5), in words the generator does not
use: `benchmarks/data/arithmetic_by_hand.jsonl` (40 questions, each with its answer, the arithmetic that
gives it and its number of operations; written for this check, not tuned on any test set). Each model answers
every question with `ar`, the models in turn on each question, at the precision `generate` runs (int4
`--exact`, greedy, batch 1, the chat template); an answer is right when the number after its `####` is the
question's (the recipes' grading), so a model that does not answer in that form scores nothing.

    python benchmarks/questions_by_hand.py --models smollm2-135m runs/start/sft
    python benchmarks/questions_by_hand.py --models runs/start/sft --show     # every reply in full
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import HERE, RESULTS, load_average, log, set_threads, write_report

from fastforward.model import load_model
from fastforward.recipes.dev_eval import decode_interleaved, summarize
from fastforward.recipes.pipeline import SERVED
from fastforward.recipes.records import read_records
from fastforward.tasks.jsonl import grade_answer

QUESTIONS = HERE / "data" / "arithmetic_by_hand.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True, help="presets, adapter folders or model directories")
    p.add_argument("--questions", type=Path, default=QUESTIONS, help="JSONL of prompt and answer lines")
    p.add_argument("--max-new-tokens", type=int, default=192, help="the arithmetic task's budget")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--show", action="store_true", help="print every reply in full")
    p.add_argument("--out", type=Path, default=RESULTS / "questions_by_hand.json")
    args = p.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    records = read_records(args.questions)
    models = {name: load_model(name, **SERVED) for name in args.models}
    # As the task asks (a question, then a new line); every model shares the base's tokenizer.
    prompts = [next(iter(models.values())).encode_prompt(r.prompt + "\n") for r in records]
    generations = decode_interleaved({n: (m, "ar", {}) for n, m in models.items()}, prompts, args.max_new_tokens)
    rows = {name: summarize(generations[name], records) for name in models}
    for name, row in rows.items():
        log(f"{name}: {sum(row['prompts']['correct'])} of {len(records)} right, {row['tps']:.1f} tokens/s")
    for i, record in enumerate(records if args.show else []):
        for name in models:
            text = generations[name][i].text
            mark = "ok" if grade_answer(text, record.answer or "").correct else "NO"
            log(f"--- {name} [{mark}, expected {record.answer}]: {record.prompt}\n{text}")
    right = {name: sum(row["prompts"]["correct"]) for name, row in rows.items()}
    write_report(args.out, load_before, threads, questions=str(args.questions), served=SERVED, right=right,
                 of=len(records), rows=rows)  # fmt: skip


if __name__ == "__main__":
    main()
