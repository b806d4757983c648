"""`fastforward lm-eval-tasks DIR`: write lm-evaluation-harness tasks over local files (ff_arithmetic, ff_humaneval)."""

from __future__ import annotations

import argparse

from fastforward.cli import add_command, positive_int
from fastforward.evaluation.lm_eval_tasks import write_tasks
from fastforward.tasks import ArithmeticTask, parse_options, task_options


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "lm-eval-tasks")
    p.add_argument("out", help="folder for the YAML, JSONL and helper files")
    p.add_argument("--n", type=positive_int, default=150, help="held-out arithmetic problems")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out problems' draw")
    p.add_argument("--max-gen-toks", type=positive_int, default=96, help="generation budget of ff_arithmetic")
    p.add_argument(
        "--task-option",
        action="append",
        metavar="NAME=VALUE",
        help=f"arithmetic task option (repeatable): {', '.join(task_options(ArithmeticTask))}",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    written = write_tasks(args.out, args.n, args.seed, args.max_gen_toks, **parse_options(args.task_option))
    for path in written:
        print(path)
    print(f"lm_eval ... --include_path {args.out} --tasks ff_arithmetic,ff_humaneval")
    return 0
