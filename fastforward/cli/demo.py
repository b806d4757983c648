"""`fastforward demo`: every method's claim on this machine, in minutes.

By default it evaluates the checkpoints shipped with fastforward (a small llama trained on
arithmetic word problems with NTP, SBD, MultiTF and SetDLM; see `fastforward/demo/checkpoints/*/provenance.json`)
on held-out problems and prints one table: accuracy, NFE, TPF (every problem, in batches), TPS and
wall speedup against AR of the same model (the first problems again at batch 1, interleaved with it);
then a real model, SmolLM2-135M-Instruct and the Jacobi Forcing adapter shipped over it
(`smollm2-135m-jf-arithmetic`), at `generate`'s defaults.
`--retrain` trains every checkpoint again from scratch with the recorded recipe (the README gives its
time) and evaluates those; `--quick` runs a short train-and-evaluate pipeline (SBD vs NTP only) to watch
training happen."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from fastforward.cli import add_command, add_precision_flags, add_threads_flag, positive_int
from fastforward.demo import showcase, zoo
from fastforward.demo.pipeline import PRESETS, DemoConfig, run_demo
from fastforward.demo.real_model import RealSettings
from fastforward.model import SHIPPED_CHECKPOINTS


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "demo", description=__doc__)
    p.add_argument("--out", default="runs/demo", help="directory for the table, records and plot (and models)")
    p.add_argument("--models", default=str(SHIPPED_CHECKPOINTS), help="checkpoints to evaluate (ntp/, sbd/, ...)")
    p.add_argument("--retrain", action="store_true", help="train every checkpoint again into --out/models first")
    p.add_argument("--quick", action="store_true", help="the few-minute train-and-evaluate pipeline instead")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write every figure of the table here")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default", help="--quick's budget ('smoke': seconds)")
    p.add_argument("--n", type=int, default=None, help="test problems to evaluate (default 150)")
    d = DemoConfig()
    p.add_argument(
        "--batch-size", type=positive_int, default=d.eval_batch_size, help="rows to a batch for accuracy, NFE, TPF"
    )
    p.add_argument(
        "--timed",
        type=int,
        default=d.eval_timed,
        metavar="M",
        help="TPS and wall vs AR from the first M problems again at batch 1, interleaved; 0: from the batched pass",
    )
    p.add_argument(
        "--real-n",
        type=int,
        default=RealSettings().n,
        help="held-out problems for the SmolLM2 rows (the base and its shipped Jacobi Forcing adapter); 0: none",
    )
    add_precision_flags(p, attention_flag=False)  # the demo decodes on the CPU: SDPA
    add_threads_flag(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    chosen = {"eval_dtype": args.dtype, "eval_quantize": args.quantize, "eval_exact": args.exact}
    chosen |= {"eval_batch_size": args.batch_size, "eval_timed": args.timed}
    if args.quick:
        config = PRESETS[args.preset]
        config = replace(config, eval_examples=args.n or config.eval_examples, **chosen)
        run_demo(args.out, config, retrain=args.retrain, json_path=args.json_path, threads=torch.get_num_threads(),
                 progress=not args.quiet)  # fmt: skip
        return 0
    threads = torch.get_num_threads()
    print(f"fastforward demo: {threads} torch thread{'s' if threads > 1 else ''}", flush=True)
    config = replace(DemoConfig(), eval_examples=args.n or DemoConfig().eval_examples, **chosen)
    models = Path(args.models)
    if args.retrain:
        models = Path(args.out) / "models"
        seconds = zoo.train_zoo(models, config)
        print("trained: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items()), flush=True)
    else:
        for name in showcase.MODELS:
            zoo.verify(models / name)
    real = RealSettings(n=args.real_n) if args.real_n > 0 else None
    showcase.show(models, args.out, config, json_path=args.json_path, progress=not args.quiet, real=real)
    return 0
