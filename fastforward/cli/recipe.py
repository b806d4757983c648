"""`fastforward recipe METHOD`: a whole training recipe on the user's own data, from one command.

`fastforward recipe jacobi-forcing --data train.jsonl --work DIR [--ship-to DIR]` runs the stages of
`fastforward.recipes.jacobi_forcing` (SFT, targets, Jacobi Forcing, an evaluation on a dev split held out
from the data, the choice of decoding defaults, a preset folder). Rerun the same command to resume.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

from fastforward.cli import DefaultsShown, add_command, add_threads_flag, positive_int


class DocstringAndDefaults(argparse.RawDescriptionHelpFormatter, DefaultsShown):
    """The recipe's docstring as written (its stages are a list), and each option's default."""


def register(sub: argparse._SubParsersAction) -> None:
    from fastforward.recipes import jacobi_forcing
    from fastforward.recipes.records import TOKENS_PER_SECOND
    from fastforward.recipes.targets import TARGETS
    from fastforward.training.objectives.jacobi_forcing import SCHEDULES

    defaults = jacobi_forcing.RecipeOptions()
    p = add_command(sub, "recipe", description=__doc__)
    methods = p.add_subparsers(dest="method", required=True)
    jf = methods.add_parser(
        "jacobi-forcing",
        help="SFT, Jacobi Forcing, a dev-split evaluation and a preset folder with its decoding defaults",
        description=jacobi_forcing.__doc__,
        formatter_class=DocstringAndDefaults,
    )
    jf.add_argument("--model", default=defaults.model, help="the base: preset, model directory or .gguf file")
    jf.add_argument(
        "--data",
        type=Path,
        required=True,
        help='JSONL of {"prompt", "completion"?, "answer"?} or GSM8K {"question", "answer"} lines',
    )
    jf.add_argument("--work", type=Path, required=True, help="the work folder (rerun with it to resume)")
    jf.add_argument("--ship-to", type=Path, help="write the finished model here as a preset folder")
    jf.add_argument(
        "--budget",
        default=defaults.budget,
        help=f"training tokens (3M, 500k) or time (90min, 3h; converted at {TOKENS_PER_SECOND:.0f} tokens/s, "
        "the rate of 2 quiet cores on SmolLM2-135M)",
    )
    jf.add_argument("--dev", type=positive_int, default=defaults.dev, help="records held out as the dev split")
    jf.add_argument("--seed", type=int, default=defaults.seed, help="seed of the dev split and of training")
    jf.add_argument(
        "--sft", action=argparse.BooleanOptionalAction, default=defaults.sft,
        help="an SFT stage on the records' completions first (when every record has one)",
    )  # fmt: skip
    jf.add_argument("--sft-share", type=float, default=defaults.sft_share, help="share of the budget for SFT")
    jf.add_argument(
        "--targets", choices=TARGETS, default=defaults.targets,
        help="train toward the start model's own greedy answers (self) or the records' completions (reference)",
    )  # fmt: skip
    jf.add_argument(
        "--answers", type=int, default=defaults.answers,
        help="train prompts the start model answers for --targets self (0: as many as one epoch of the budget needs)",
    )  # fmt: skip
    jf.add_argument("--block-size", type=positive_int, default=defaults.block_size, help="training block size")
    jf.add_argument(
        "--blocks", type=positive_int, nargs="+", default=list(defaults.blocks),
        help="jacobi block sizes measured on the dev split (the fastest becomes the default)",
    )  # fmt: skip
    jf.add_argument("--noise-schedule", choices=SCHEDULES, default=defaults.noise_schedule, help="noise in a window")
    jf.add_argument("--ar-weight", type=float, default=defaults.ar_weight, help="AR loss weight (CLLM: 10)")
    jf.add_argument("--lora-rank", type=positive_int, default=defaults.lora_rank, help="LoRA rank of each stage")
    jf.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    jf.add_argument("--seq-len", type=positive_int, default=defaults.seq_len, help="tokens per training row")
    jf.add_argument("--batch-size", type=positive_int, default=defaults.batch_size, help="rows per step")
    jf.add_argument("--curve", type=positive_int, default=defaults.curve, help="points of the learning curve")
    jf.add_argument("--curve-n", type=positive_int, default=defaults.curve_n, help="dev records at each curve point")
    jf.add_argument(
        "--control", action="store_true",
        help="also train an NTP control (the same start, data and steps) and measure its accuracy",
    )  # fmt: skip
    jf.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens, help="per answer")
    jf.add_argument("--no-eval", action="store_true", help="train only (a later rerun evaluates and ships)")
    add_threads_flag(jf)
    jf.set_defaults(run=run_jacobi_forcing)


def run_jacobi_forcing(args: argparse.Namespace) -> int:
    from fastforward.recipes.jacobi_forcing import Recipe, RecipeOptions, command_line

    chosen = {f.name: getattr(args, f.name) for f in fields(RecipeOptions) if f.name in vars(args)}
    options = RecipeOptions(**{**chosen, "blocks": tuple(args.blocks)})
    options = replace(options, command=command_line(options, args.data, args.work, args.ship_to))
    recipe = Recipe(args.data, args.work, options, log=lambda line: print(line, flush=True))
    record = recipe.run(ship_to=args.ship_to, evaluate=not args.no_eval)
    if record is not None:
        defaults = record["defaults"]
        print(f"decoding defaults: {defaults['decoder']} {defaults['options']} ({defaults['measured']})")
        where = args.ship_to or args.work / "shipped"
        print(f"try it: fastforward generate --model {where} PROMPT", flush=True)
    return 0
