"""`fastforward jacobi-forcing`: progressive Jacobi Forcing rounds — collect, train, repeat with bigger blocks.

Round r collects the Jacobi trajectories of the previous round's model (round 1: --model) at block
size n_r into OUT/trajectories-round-r.jsonl, then trains that model on them into OUT/round-r (a
`fastforward train` run directory; its final model is what round r+1 starts from). Rerun the same
command to resume: finished rounds are skipped, a trajectory file is completed, an unfinished
training run continues from its last checkpoint (`fastforward.training.rounds`). With --states
random-tail nothing is collected: each round trains on the task's worked solutions (or the
"completion" of every --prompts line) with random tails as noisy blocks.
"""

from __future__ import annotations

import argparse

from fastforward.cli import add_command, add_threads_flag
from fastforward.cli.train import add_knob_flag, add_only_correct_flag, add_optimizer_flags, rule, train_config
from fastforward.cli.trajectories import add_collect_flags, add_prompt_flags, collection, load_prompt_source
from fastforward.errors import FastForwardError
from fastforward.options import options_of
from fastforward.training.objectives import JacobiForcing
from fastforward.training.rounds import Round, per_round, progressive_rounds


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "jacobi-forcing", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file to start from")
    p.add_argument("--out", required=True, help="directory of the rounds: trajectories-round-R.jsonl, round-R/")
    add_prompt_flags(p)
    p.add_argument("--rounds", type=int, default=2, help="rounds of trajectory collection and training")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32], help="block size of each round")
    p.add_argument("--noise-windows", type=int, nargs="+", default=[16, 8], help="window w of each round")
    add_collect_flags(p)
    knobs = options_of(JacobiForcing)
    for name in ("noise_schedule", "noisy_context", "ar_weight", "states"):  # the objective's own
        add_knob_flag(p, knobs[name], knobs[name].help + rule(knobs[name]))
    add_only_correct_flag(p)
    add_optimizer_flags(p, seq_len=1024)  # a row holds the prompt and the response twice
    add_threads_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise FastForwardError(f"--rounds must be at least 1, got {args.rounds}")
    sizes = per_round(args.block_sizes, args.rounds, "--block-sizes")
    windows = per_round(args.noise_windows, args.rounds, "--noise-windows")
    final = progressive_rounds(
        args.model,
        args.out,
        load_prompt_source(args),
        [Round(size, window) for size, window in zip(sizes, windows, strict=True)],
        JacobiForcing(args.noise_schedule, windows[0], args.noisy_context, args.ar_weight, args.states),
        train_config(args, eval_every=0),
        collection(args),
        dtype=args.dtype,
        only_correct=args.only_correct,
        log=lambda line: print(line, flush=True),
    )
    print(f"final model: {final} (fastforward generate --decoder jacobi --model {final})", flush=True)
    return 0
