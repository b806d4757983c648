"""`fastforward demo`: train a small model from scratch on arithmetic word problems, fine-tune one
copy with NTP and one with SBD, and show the SBD paper's Table 1 on this machine: accuracy, NFE
speedup and wall-clock speedup of SBD decoding at a low and a high γ against AR decoding, plus the
accuracy-vs-TPF plot over a γ sweep. A second run reuses the trained models."""

from __future__ import annotations

import argparse
from dataclasses import replace

from fastforward.demo import PRESETS, run_demo


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="reproduce SBD's headline claim end to end on a small model (about 10-15 min on 2 CPU cores)",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="runs/demo", help="directory for the models, table, records and plot")
    p.add_argument("--retrain", action="store_true", help="train the models again even if --out holds them")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write every figure of the table here")
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default="default", help="budget ('smoke': seconds, no learning)"
    )
    p.add_argument("--n", type=int, default=None, help="test problems to evaluate (default: the preset's)")
    p.add_argument("--gamma-low", type=float, default=None, help="the table's low γ (default: the preset's)")
    p.add_argument("--gamma-high", type=float, default=None, help="the table's high γ (default: the preset's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores not busy)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = PRESETS[args.preset]
    changes = {"eval_examples": args.n, "gamma_low": args.gamma_low, "gamma_high": args.gamma_high}
    config = replace(config, **{k: v for k, v in changes.items() if v is not None})
    run_demo(
        args.out, config, retrain=args.retrain, json_path=args.json_path, threads=args.threads, progress=not args.quiet
    )
    return 0
