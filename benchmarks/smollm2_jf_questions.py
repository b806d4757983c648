"""A shipped preset on grade-school questions written by hand, asked as a user would.

`smollm2-135m-jf-arithmetic` was trained on the `arithmetic` task's generated problems, and its
figures in docs/results.md are on held-out problems from the same generator. These twelve questions
were written by hand in other words (the numbers in its range: at most 20, factors up to 5, two or
three steps), to show what a preset does with a question phrased as a person would phrase it. Each is
asked with `generate`'s defaults for the preset (int4 `--exact`, greedy, batch 1, the chat
template): `ar` and the preset's own decoding defaults (`decoding.json`) on the adapter, and `ar` on
the base model without it. The answer read is the number after `####`, else the last number of the reply.

    python benchmarks/smollm2_jf_questions.py
    python benchmarks/smollm2_jf_questions.py --model DIR --show     # another preset; every reply in full
"""

from __future__ import annotations

import argparse
from decimal import Decimal
from pathlib import Path

from common import RESULTS, load_average, log, set_threads, write_report

from fastforward.decoding.model_defaults import model_decoding_defaults
from fastforward.model import load_model
from fastforward.recipes.dev_eval import decode_interleaved
from fastforward.recipes.pipeline import SERVED
from fastforward.tasks.arithmetic import parse_answer

BASE = "smollm2-135m"
QUESTIONS = (  # (question, answer); worked out by hand
    ("A baker made 12 muffins in the morning and 8 more in the afternoon. He sold 14 of them. "
     "How many muffins are left?", 6),
    ("There are 4 boxes with 5 pencils in each box. Sam takes 3 pencils. How many pencils are still in the boxes?", 17),
    ("Lena reads 6 pages every day for 3 days, then 10 pages on Sunday. How many pages did she read in total?", 28),
    ("A class has 18 students. 7 of them go home early and 4 new students arrive. "
     "How many students are in the class now?", 15),
    ("Tom buys 3 packs of cards. Each pack has 6 cards. He gives half of his cards to his sister. "
     "How many cards does Tom keep?", 9),
    ("A farmer has 20 eggs. He puts them into cartons that hold 5 eggs each. How many cartons does he fill?", 4),
    ("Ana saves $7 each week for 4 weeks. Then she spends $10 on a book. How much money does she have left?", 18),
    ("A bus has 11 passengers. At the first stop 6 people get on, and at the second stop 9 people get off. "
     "How many passengers are on the bus now?", 8),
    ("There are 5 children and each child gets 3 apples. How many apples are needed?", 15),
    ("Ben had 16 marbles. He lost 5 of them, then won twice as many as he lost. "
     "How many marbles does he have now?", 21),
    ("A garden has 3 rows of tulips with 4 tulips in each row, and 2 rows of roses with 6 roses in each row. "
     "How many flowers are in the garden?", 24),
    ("Max runs 2 miles on Monday, 3 miles on Tuesday, and twice as far on Wednesday as on Tuesday. "
     "How many miles does he run in total?", 11),
)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-jf-arithmetic", help="a preset with decoding defaults")
    p.add_argument("--max-new-tokens", type=int, default=192, help="the arithmetic task's budget")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--show", action="store_true", help="print every reply in full")
    p.add_argument("--out", type=Path, default=RESULTS / "smollm2_jf_questions.json")
    args = p.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    adapted, base = load_model(args.model, **SERVED), load_model(BASE, **SERVED)
    defaults = model_decoding_defaults(args.model)
    default = (defaults.decoder, dict(defaults.options)) if defaults is not None else ("ar", {})
    fast = "adapter, " + " ".join([default[0], *(str(v) for v in default[1].values())])
    contenders = {  # label: (model, decoder, options)
        "adapter, ar": (adapted, "ar", {}),
        fast: (adapted, *default),
        "base, ar": (base, "ar", {}),
    }
    # As the task asks (a question, then a new line); the base shares the adapter's tokenizer.
    prompts = [adapted.encode_prompt(question + "\n") for question, _ in QUESTIONS]
    generations = decode_interleaved(contenders, prompts, args.max_new_tokens, desc="questions")
    rows = []
    for i, (question, answer) in enumerate(QUESTIONS):
        row = {"question": question, "answer": answer}
        for label in contenders:
            g = generations[label][i]
            got = parse_answer(g.text, strict=False)
            row[label] = {
                "text": g.text,
                "read": None if got is None else f"{got.normalize():f}",
                "correct": got == Decimal(answer),
                "tokens": g.stats.tokens,
                "forwards": g.stats.nfe,
            }
            if args.show:
                log(f"--- {label}: {question}\n{g.text}")
        row["defaults equal ar"] = generations[fast][i].token_ids == generations["adapter, ar"][i].token_ids
        rows.append(row)
        ar, fastest, plain = row["adapter, ar"], row[fast], row["base, ar"]
        log(
            f"{question[:60]:60}  expected {answer:>3}  adapter {ar['read']!s:>5} {'ok ' if ar['correct'] else 'NO '}"
            f" forwards ar {ar['forwards']:3} defaults {fastest['forwards']:3}"
            f" {'same tokens' if row['defaults equal ar'] else 'DIFFERENT tokens'}"
            f"  base {plain['read']!s:>5} {'ok' if plain['correct'] else 'NO'}"
        )
    totals = {label: sum(r[label]["correct"] for r in rows) for label in contenders}
    forwards = {label: sum(r[label]["forwards"] for r in rows) for label in contenders}
    tokens = sum(r[fast]["tokens"] for r in rows)
    log(
        f"\ncorrect of {len(rows)}: adapter {totals['adapter, ar']} ({fast}: {totals[fast]}), "
        f"base {totals['base, ar']}; the defaults = ar on {sum(r['defaults equal ar'] for r in rows)} of {len(rows)}; "
        f"forwards ar {forwards['adapter, ar']}, the defaults {forwards[fast]} "
        f"(TPF {tokens / max(forwards[fast], 1):.2f})"
    )
    write_report(args.out, load_before, threads, model=args.model, defaults=fast, base=BASE, served=SERVED,
                 correct=totals, forwards=forwards, rows=rows)  # fmt: skip


if __name__ == "__main__":
    main()
