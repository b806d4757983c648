"""`fastforward trajectories`: write a model's Jacobi trajectories over prompts (rerun the command to resume).

Several processes share the prompts: `torchrun --nproc_per_node N -m fastforward trajectories ...` (with
`--device cuda`, process k takes GPU k); the file is the one a single process writes."""

from __future__ import annotations

import argparse

from fastforward.cli import add_adapter_flag, add_command, add_dtype_flag, add_threads_flag, precision
from fastforward.decoding.decoders.jacobi import DRAFT_INITS
from fastforward.errors import FastForwardError
from fastforward.model import load_model
from fastforward.tasks import parse_options
from fastforward.training.launch import launched_processes, local_rank, reported_once, say, share_threads
from fastforward.training.trajectories.shards import collect_shards
from fastforward.training.trajectories.sources import (
    Collection,
    PromptSource,
    collect_from,
    read_prompts,
    task_prompts,
)
from fastforward.training.trajectories.writer import describe


def add_prompt_flags(p: argparse.ArgumentParser) -> None:
    """Where the prompts come from: a JSONL file or a task's examples."""
    p.add_argument("--prompts", help='JSONL of {"prompt": ...} records (an "id" is kept)')
    p.add_argument("--task", help="take the prompts of a task's examples instead (e.g. arithmetic)")
    p.add_argument("--task-option", action="append", metavar="NAME=VALUE", help="a task option (repeatable)")
    p.add_argument("--split", default="train", help="the task split the prompts come from")
    p.add_argument("--n", type=int, default=None, help="number of task examples (default: the task's own)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the task's example draw")


def load_prompt_source(args: argparse.Namespace) -> PromptSource:
    """The prompts of --prompts, or of --task (then graded, with the task's generation budget)."""
    if bool(args.prompts) == bool(args.task):
        raise FastForwardError("give exactly one of --prompts FILE and --task NAME")
    if args.prompts:
        return PromptSource(*read_prompts(args.prompts))
    return task_prompts(args.task, args.n, args.split, args.prompt_seed, parse_options(args.task_option))


def add_collect_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="rounded up to whole blocks (default: 256 or the task's)"
    )
    p.add_argument(
        "--init", choices=DRAFT_INITS, default="repeat", help="how the jacobi decoder fills fresh draft slots"
    )
    p.add_argument("--collect-batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "trajectories", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    p.add_argument("--out", required=True, help="JSONL file to write (appended to when it exists)")
    add_prompt_flags(p)
    p.add_argument("--block-size", type=int, default=16, help="tokens per Jacobi block (n)")
    add_collect_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seed of random drafts (with the prompt, keys them)")
    add_dtype_flag(p)
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    add_adapter_flag(p)
    add_threads_flag(p)
    p.set_defaults(run=run)


def collection(args: argparse.Namespace) -> Collection:
    """The collection settings of `add_collect_flags` (shared by both commands) and --seed."""
    return Collection(
        max_new_tokens=args.max_new_tokens,
        init=args.init,
        batch_size=args.collect_batch_size,
        seed=args.seed,
        chat_template=not args.no_chat_template,
    )


@reported_once
def run(args: argparse.Namespace) -> int:
    share_threads(args.threads)
    source = load_prompt_source(args)
    sharded = launched_processes() > 1
    device = f"cuda:{local_rank()}" if sharded and args.device == "cuda" else args.device
    model = load_model(args.model, device=device, precision=precision(args))  # --dtype and --adapter
    collect_all = collect_shards if sharded else collect_from
    summary = collect_all(model, source, collection(args), args.out, args.block_size)
    say(
        f"{summary.written} prompts written, {summary.skipped} already there → {args.out} "
        f"({describe(summary, source.grade is not None)} this run)"
    )
    return 0
