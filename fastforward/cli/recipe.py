"""`fastforward recipe METHOD`: a whole training recipe on the user's own data, from one command.

`fastforward recipe jacobi-forcing --data train.jsonl --work DIR [--ship-to DIR]` runs the stages of
`fastforward.recipes.pipeline` around the method's own training (SFT, targets, training, an evaluation on a
dev split held out from the data, the choice of decoding defaults, a preset folder); `fastforward recipe
sbd` does the same with Set Block Decoding. Rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from fastforward.cli import DefaultsShown, add_command, add_threads_flag
from fastforward.errors import FastForwardError
from fastforward.options import Knob, options_of

if TYPE_CHECKING:
    from fastforward.recipes.records import DataFile, TaskData


class DocstringAndDefaults(argparse.RawDescriptionHelpFormatter, DefaultsShown):
    """A recipe's docstring as written (its stages are a list), and each option's default."""


def register(sub: argparse._SubParsersAction) -> None:
    from fastforward.recipes.pipeline import RECIPES

    p = add_command(sub, "recipe", description=__doc__)
    methods = p.add_subparsers(dest="method", required=True)
    for name, recipe in RECIPES.items():
        doc = sys.modules[recipe.__module__].__doc__
        q = methods.add_parser(name, help=recipe.summary, description=doc, formatter_class=DocstringAndDefaults)
        source = q.add_mutually_exclusive_group(required=True)
        source.add_argument(
            "--data", type=Path,
            help='JSONL of {"prompt", "completion"?, "answer"?} or GSM8K {"question", "answer"} lines',
        )  # fmt: skip
        source.add_argument("--task", help="or a built-in task's train split with worked solutions (arithmetic)")
        q.add_argument("--problems", type=int, help="problems drawn from --task's train split (default: 2000)")
        q.add_argument("--task-option", action="append", default=[], metavar="K=V", help="--task's knob (repeat)")
        q.add_argument("--work", type=Path, required=True, help="the work folder (rerun with it to resume)")
        q.add_argument("--ship-to", type=Path, help="write the finished model here as a preset folder")
        for option_name, knob in options_of(recipe.options_class).items():
            add_option_flag(q, recipe.options_class.flag(option_name), knob)
        q.add_argument("--no-eval", action="store_true", help="train only (a later rerun evaluates and ships)")
        add_threads_flag(q)
        q.set_defaults(run=run, recipe=name)


def add_option_flag(p: argparse.ArgumentParser, flag: str, knob: Knob) -> None:
    """One flag for one recipe option (`fastforward.options`), stored under the option's name: a switch for a
    bool, several values for a tuple, else one value of the default's type; its rule is checked when the
    options are made."""
    default, dest = knob.default, knob.name
    if isinstance(default, bool):
        p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=knob.help)
    elif isinstance(default, tuple):
        p.add_argument(flag, dest=dest, type=type(default[0]), nargs="+", default=list(default), help=knob.help)
    else:
        p.add_argument(flag, dest=dest, type=type(default), default=default, choices=knob.choices, help=knob.help)


def data_source(args: argparse.Namespace) -> DataFile | TaskData:
    """`--data FILE`, or `--task NAME` with its options and problem count."""
    from fastforward.recipes.records import DataFile, TaskData
    from fastforward.tasks import parse_options

    if args.data is not None:
        if args.problems is not None or args.task_option:
            raise FastForwardError("--problems and --task-option shape --task's problems; --data FILE takes neither")
        return DataFile(args.data)
    args.problems = 2000 if args.problems is None else args.problems
    if args.problems < 2:
        raise FastForwardError(f"--problems {args.problems}: draw at least 2 (some train, some dev)")
    return TaskData(args.task, args.problems, tuple(parse_options(args.task_option).items()))


def run(args: argparse.Namespace) -> int:
    from fastforward.recipes.pipeline import RECIPES

    recipe_class = RECIPES[args.recipe]
    given = {f.name: getattr(args, f.name) for f in fields(recipe_class.options_class)}
    options = recipe_class.options_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    recipe = recipe_class(data_source(args), args.work, options, log=lambda line: print(line, flush=True))
    record = recipe.run(ship_to=args.ship_to, evaluate=not args.no_eval)
    if record is not None:
        defaults = record["defaults"]
        print(f"decoding defaults: {defaults['decoder']} {defaults['options']} ({defaults['measured']})")
        where = args.ship_to or args.work / "shipped"
        print(f"try it: fastforward generate --model {where} PROMPT", flush=True)
    return 0
