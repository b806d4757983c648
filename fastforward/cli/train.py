"""`fastforward train`: fine-tune a causal LM with an objective; rerun the same command to resume.

Several processes: `torchrun --nproc_per_node N -m fastforward train ...` or `accelerate launch
--multi_gpu --num_processes N -m fastforward train ...`; --batch-size is per process."""

from __future__ import annotations

import argparse

from fastforward.cli import add_command, add_dtype_flag, add_threads_flag
from fastforward.errors import FastForwardError
from fastforward.model import flex, load_model
from fastforward.options import Knob
from fastforward.training.data import PackedData, load_examples, split_examples
from fastforward.training.launch import reported_once, say, share_threads
from fastforward.training.objectives import OBJECTIVES, make_objective
from fastforward.training.objectives.registry import options
from fastforward.training.trainer import TrainConfig, default_autocast, train
from fastforward.training.trajectories.dataset import TrajectoryData, from_examples, trajectory_datasets


def register(sub: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = add_command(sub, "train", description=__doc__)
    p.add_argument("--objective", choices=sorted(OBJECTIVES), default="sbd", help="what the model learns")
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    p.add_argument("--data", help="JSONL of {prompt, completion} or {text} lines")
    p.add_argument("--trajectories", help="JSONL of Jacobi trajectories (jacobi_forcing; `fastforward trajectories`)")
    p.add_argument("--out", required=True, help="run directory: checkpoints, metrics, final model")
    p.add_argument("--overwrite", action="store_true", help="discard the run already in --out")
    p.add_argument("--eval-data", help="JSONL held out for evaluation (trajectories for jacobi_forcing)")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="hold out this share of --data instead")
    p.add_argument("--no-chat-template", action="store_true", help="join prompt and completion as raw text")
    add_optimizer_flags(p, seq_len=TrainConfig().seq_len)
    p.add_argument(
        "--lora-from",
        default="",
        help="continue training this LoRA adapter directory, with a fresh optimizer and schedule (give its "
        "--lora-rank and, as --model, the base it was trained on)",
    )
    add_objective_flags(p)
    add_only_correct_flag(p)
    p.add_argument(
        "--attention",
        choices=("auto", *flex.CHOICES),
        default="auto",
        help="sdpa (dense masks) or flex (FlexAttention, trains on GPUs only); auto: flex on a CUDA GPU, except ntp",
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evaluations")
    p.add_argument("--max-eval-batches", type=int, default=d.max_eval_batches, help="batches per evaluation")
    add_threads_flag(p)
    p.set_defaults(run=run)


def add_objective_flags(p: argparse.ArgumentParser) -> None:
    """One flag per option of the registered objectives (`objectives.registry.options`), naming the
    objectives that take it; `run` checks the values against the same declarations."""
    for option in options().values():
        add_knob_flag(p, option.knob, f"{option.knob.help}{rule(option.knob)} ({', '.join(option.objectives)})")


def add_knob_flag(p: argparse.ArgumentParser, knob: Knob, help: str) -> None:
    """The flag of an option (`fastforward.options`), at the option's default."""
    kind = {"action": argparse.BooleanOptionalAction} if knob.type is bool else {"type": knob.type}
    p.add_argument(knob.flag, default=knob.default, choices=knob.choices, help=help, **kind)


def rule(knob: Knob) -> str:
    """What an option's values must be, for its help: "; must be > 0" (choices show themselves)."""
    return f"; must be {knob.bound.rule}" if knob.bound else ""


def add_only_correct_flag(p: argparse.ArgumentParser) -> None:
    """--only-correct, shared by `train` and `jacobi-forcing`."""
    p.add_argument(
        "--only-correct",
        action="store_true",
        help="jacobi_forcing: train only on trajectories whose response was graded correct (collected from a --task)",
    )


def add_optimizer_flags(p: argparse.ArgumentParser, seq_len: int) -> None:
    """The trainer's flags shared by every command that trains (see `train_config`)."""
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per packed row")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per device per micro-batch")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps (then cosine decay)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's weight decay")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="0 disables clipping")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="latest checkpoints kept")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of initialisation, data order and masking")
    add_dtype_flag(p)
    p.add_argument(
        "--lora-rank",
        type=int,
        default=d.lora_rank,
        help="train a LoRA adapter of this rank (PEFT) instead of every weight; 0: full fine-tuning",
    )
    p.add_argument("--lora-alpha", type=float, default=d.lora_alpha, help="LoRA's alpha (0: twice the rank)")
    p.add_argument(
        "--lora-targets", default=d.lora_targets, help="modules given LoRA layers: all-linear or names, comma-separated"
    )
    p.add_argument(
        "--lora-layers",
        type=int,
        default=d.lora_layers,
        help="LoRA layers on the top N decoder layers only, where the backward pass then stops (0: every layer)",
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast; weights and optimizer stay in --dtype (default: on with a CUDA GPU or a CPU with "
        "bfloat16 arithmetic, AVX-512 BF16 or AMX; benchmarks/train_speed.py)",
    )


def train_config(args: argparse.Namespace, **overrides) -> TrainConfig:
    """A validated TrainConfig from `add_optimizer_flags` flags (plus per-command settings)."""
    config = TrainConfig(
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        mixed_precision=default_autocast() if args.bf16 is None else ("bf16" if args.bf16 else "no"),
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        lora_layers=args.lora_layers,
        **overrides,
    )
    config.validate()
    return config


@reported_once
def run(args: argparse.Namespace) -> int:
    share_threads(args.threads)
    config = train_config(
        args, eval_every=args.eval_every, max_eval_batches=args.max_eval_batches, lora_from=args.lora_from
    )
    chosen = {name: getattr(args, name) for name in options() if getattr(args, name) is not None}
    # the options it does not take are left out; a bad value is refused naming its flag
    objective = make_objective(args.objective, label=lambda knob: knob.flag, **chosen)
    on_trajectories = args.objective == "jacobi_forcing" and not args.data
    if bool(args.trajectories) != on_trajectories or not (on_trajectories or args.data):
        raise FastForwardError(
            "give --trajectories FILE to the jacobi_forcing objective (write one with `fastforward trajectories`; "
            "or --data FILE of ground-truth responses with --states random-tail) and --data FILE to the others"
        )
    references = args.objective == "jacobi_forcing" and bool(args.data)
    if references and objective.states != "random-tail":
        raise FastForwardError(
            "jacobi_forcing on --data (ground-truth responses, no Jacobi iterates) needs --states random-tail; "
            "for rollout states give --trajectories"
        )
    if args.only_correct and not on_trajectories:
        raise FastForwardError("--only-correct filters Jacobi trajectories: use it with --objective jacobi_forcing")
    try:
        model = load_model(args.model, dtype=args.dtype, attention=flex.for_training(args.attention, args.objective))
    except flex.FlexUnsupported:
        if args.attention != "auto":
            raise
        model = load_model(args.model, dtype=args.dtype, attention="sdpa")  # auto: what this model runs
    if on_trajectories:
        train_data, eval_data = trajectory_datasets(
            args.trajectories, args.seq_len, args.eval_data, args.eval_fraction, args.seed, args.only_correct
        )
        say(f"{len(train_data)} trajectories in rows of up to {args.seq_len} tokens")
    else:
        chat = not args.no_chat_template
        examples = load_examples(args.data, model.tokenizer, chat)
        held = load_examples(args.eval_data, model.tokenizer, chat) if args.eval_data else None
        if held is None and args.eval_fraction:
            examples, held = split_examples(examples, args.eval_fraction, args.seed)
        if references:  # ground-truth responses cut into blocks, states drawn by the objective
            pad, n = model.pad_token_id, objective.block_size
            train_data = TrajectoryData(from_examples(examples, n, pad), args.seq_len)
            eval_data = TrajectoryData(from_examples(held, n, pad), args.seq_len) if held else None
            say(f"{len(examples)} ground-truth responses in blocks of {n}, rows of up to {args.seq_len} tokens")
        else:
            train_data = PackedData(examples, args.seq_len, model.pad_token_id)
            eval_data = PackedData(held, args.seq_len, model.pad_token_id) if held else None
            say(f"{len(examples)} examples → {len(train_data)} rows of {args.seq_len} tokens")
    train(model, objective, train_data, config, args.out, eval_data=eval_data, overwrite=args.overwrite)
    what = "a LoRA adapter" if args.lora_rank else "the model"
    say(f"saved {what} in {args.out} (fastforward generate --model {args.out})")
    return 0
