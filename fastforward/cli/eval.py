"""`fastforward eval`: a model × decoder × task → accuracy, NFE, TPF, TPS and speedup against AR
decoding of the same model, measured in the same run; `--sweep` a decoder knob for the
accuracy-vs-TPF curve, its AUP, a PNG plot and JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

from fastforward.api import build_decoder
from fastforward.cli import (
    add_command,
    add_compile_flag,
    add_precision_flags,
    add_threads_flag,
    positive_int,
    precision,
)
from fastforward.cli.decoding import add_decoder_flags, decoder_knobs
from fastforward.decoding.decoders import registry
from fastforward.demo import zoo
from fastforward.evaluation.evaluate import AR, compare, parse_sweep, sweep_label
from fastforward.evaluation.report import how_measured, results_table, write_json, write_records
from fastforward.model import check_device, load_model, resolve_model_path
from fastforward.tasks import get_task, parse_options
from fastforward.training.launch import launched_processes, local_rank, reported_once, share_threads


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "eval", description=__doc__)
    p.add_argument("--model", required=True, help="preset, model directory or .gguf file")
    p.add_argument("--task", required=True, help="arithmetic, pycode, humaneval, or a JSONL file of {prompt, answer}")
    p.add_argument(
        "--task-option", action="append", default=[], metavar="K=V", help="task knob, e.g. max_number=20 (repeat)"
    )
    p.add_argument("--split", default="test", help="the task split the examples come from")
    p.add_argument("--n", type=int, default=100, help="examples to evaluate")
    p.add_argument("--seed", type=int, default=0, help="which examples (for generated tasks), and the decoder's seed")
    add_decoder_flags(p, default="sbd", skip=("seed",))
    p.add_argument(
        "--sweep",
        metavar="KNOB=V1,V2,...",
        help="evaluate the decoder at each value of one knob, e.g. gamma=0,0.1,0.35,1 (curve, AUP, plot)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's own budget")
    p.add_argument("--batch-size", type=positive_int, default=1, help="prompts decoded together; timings are per batch")
    p.add_argument(
        "--timed",
        type=positive_int,
        metavar="M",
        help="tokens/s and speedup from the first M examples again at batch 1, interleaved; accuracy and TPF "
        "from all --n at --batch-size",
    )
    add_precision_flags(p, dtype="float32", quantize="none", exact=False)
    add_compile_flag(p)
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    p.add_argument("--out", default=None, help="directory for results.json, records.jsonl (and sweep.png, sweep.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_threads_flag(p)
    p.set_defaults(run=run)


@reported_once
def run(args: argparse.Namespace) -> int:
    """One process, or in a `torchrun` launch every process on its share of the batches (process 0
    prints and writes: the same figures, tokens/s per process)."""
    if launched_processes() == 1:
        return evaluate_command(args)
    share_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        return evaluate_command(args, shard=(dist.get_rank(), dist.get_world_size()))
    finally:
        dist.destroy_process_group()


def evaluate_command(args: argparse.Namespace, shard: tuple[int, int] = (0, 1)) -> int:
    check_device(args.device)
    if shard[1] > 1 and args.device and args.device.startswith("cuda"):
        args.device = f"cuda:{local_rank()}"
    knobs = decoder_knobs(args)
    if registry.spec(args.decoder).knob("seed"):
        knobs["seed"] = args.seed
    trained_for = zoo.task_options(resolve_model_path(args.model), args.task)
    if trained_for and shard[0] == 0:
        print(f"task options the checkpoint was trained for: {trained_for} (--task-option overrides)")
    task = get_task(args.task, **{**trained_for, **parse_options(args.task_option)})
    sweep_spec = parse_sweep(args.sweep) if args.sweep else None
    if sweep_spec:
        name, values = sweep_spec
        decoders = {sweep_label(name, v): build_decoder(args.decoder, **{**knobs, name: v}) for v in values}
    else:
        decoder = build_decoder(args.decoder, **knobs)
        greedy_ar = args.decoder == "ar" and knobs.get("temperature", 0) == 0
        decoders = {} if greedy_ar else {args.decoder: decoder}
    model = load_model(args.model, device=args.device, precision=precision(args))
    results = compare(
        model,
        task,
        decoders,
        n=args.n,
        split=args.split,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        timed=args.timed,
        chat_template=not args.no_chat_template,
        progress=not args.quiet and shard[0] == 0,
        shard=shard,
    )
    if shard[0] != 0:
        return 0  # process 0 reports
    ordered = [results[AR]] + [results[label] for label in decoders]
    print(f"{task.name} ({args.split}), model {args.model}: {how_measured(ordered)}")
    print(results_table(ordered))
    summary = {
        "model": args.model,
        "task": task.describe(),
        "split": args.split,
        "seed": args.seed,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens or task.max_new_tokens,
        "results": [r.summary() for r in ordered],
    }
    if sweep_spec:
        from fastforward.evaluation.plots import plot_sweep
        from fastforward.evaluation.results import SweepResult

        name, values = sweep_spec
        curve = SweepResult(name, values, [results[label] for label in decoders], results[AR])
        summary["sweep"] = curve.summary()
        aup = curve.aup
        print(f"AUP over {name} = {', '.join(map(str, values))}: " + ("-" if aup is None else f"{aup:.2f}"))
    if args.out:
        out = Path(args.out)
        write_json(out / "results.json", summary)
        write_records(out / "records.jsonl", ordered)
        written = [out / "results.json", out / "records.jsonl"]
        if sweep_spec:
            write_json(out / "sweep.json", summary["sweep"])
            plot_sweep(out / "sweep.png", curve, name=args.decoder, model=Path(args.model).name or args.model)
            written += [out / "sweep.json", out / "sweep.png"]
        print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0
