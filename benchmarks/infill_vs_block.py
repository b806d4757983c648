"""Infilling: Set Diffusion (`setdlm`'s infill) against block diffusion (the SBD model decoding the gap
block by block with the prefix and the suffix in its context), the SW-SetDLM paper's comparison with
BD3LM at CPU scale (issue 54, item 4).

Task: `arithmetic-number-infill` (one number of the problem hidden; only the suffix, the rest of the
problem and its worked solution, gives it away) and `arithmetic-infill` (a calculation line hidden,
longer gaps). The gap's length is given (the reference's token count), as in the paper.

* block diffusion: `BlockInfill` below, the `sbd` decoder on a session whose suffix is in the KV cache
  up front at its true positions (after the gap), so every block of masks sees the prefix, the
  suffix and the blocks before it; blocks of --block tokens, the threshold policy at --taus (τ = ∞
  reveals one token per forward, the most confident);
* Set Diffusion: `setdlm` with the suffix up front (the same context as block diffusion) and
  promoted as the window reaches it, at the windows and thresholds given;
* AR of each model from the prefix alone (`compare`'s baseline: it never sees the suffix), and `sbd`
  from the prefix alone (what the suffix adds to block diffusion).

Each row: exact match, ROUGE-L, NFE per example, TPF, tokens/s (of the gap's tokens, wall clock,
1 row at a time). The forward budget is matched by NFE per example: τ = ∞ and window 1 spend one
forward per gap token on both sides.

    python benchmarks/infill_vs_block.py --threads 1
    python benchmarks/infill_vs_block.py --threads 1 --n 3 --results /tmp/i      # smoke

Writes benchmarks/results/infill_vs_block.json (or --results DIR).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from common import log, machine_info, result_columns, result_row, set_threads, task_shape

from fastforward.api import build_decoder
from fastforward.decoding.decoders.sbd import SBDDecoder
from fastforward.decoding.policies import make_policy
from fastforward.decoding.runtime import Session
from fastforward.demo.pipeline import DemoConfig
from fastforward.evaluation.evaluate import compare
from fastforward.evaluation.report import format_table, write_json
from fastforward.model import load_model
from fastforward.tasks import get_task

CHECKPOINTS = Path(__file__).resolve().parents[1] / "fastforward" / "demo" / "checkpoints"


class BlockInfill(SBDDecoder):
    """Block diffusion infilling: SBD's blocks over the gap, the suffix cached up front at its true
    positions, so a block's masks see the prefix, the finished blocks and the suffix."""

    name = "block-infill"
    infills = True
    continuous = False  # one row at a time through `generate`'s loop is enough here
    suffix_upfront = True

    def decode(self, session: Session) -> None:
        self.begin(session, range(session.batch))
        while not session.finished:
            self.step(session)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sbd", default=str(CHECKPOINTS / "sbd"), help="the block diffusion model")
    p.add_argument("--setdlm", default=str(CHECKPOINTS / "setdlm"), help="the Set Diffusion model(s), comma-separated")
    p.add_argument("--tasks", default="arithmetic-number-infill,arithmetic-infill")
    p.add_argument("--n", type=int, default=150)
    p.add_argument("--block", type=int, default=4, help="block diffusion's block size")
    p.add_argument("--taus", default="inf,0.9", help="block diffusion's threshold policy (inf: one token a forward)")
    p.add_argument("--windows", default="1,4", help="setdlm windows")
    p.add_argument("--threshold", type=float, default=0.9, help="setdlm's threshold (window 1: one token a forward)")
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    threads = set_threads(args.threads)
    load_before = machine_info(load=True)["load_average"]
    config = DemoConfig()
    options = dict(max_new_tokens=config.max_new_tokens, chat_template=False, progress=False)
    taus = [float(t) for t in args.taus.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    rows: list[dict] = []
    started = time.perf_counter()
    for task_name in args.tasks.split(","):
        task = get_task(task_name, **task_shape(config))
        examples = task.examples("test", n=args.n, seed=config.seed)
        block = {
            f"block diffusion b={args.block} τ={t:g}": BlockInfill(args.block, make_policy("threshold", t))
            for t in taus
        }
        prefix_only = build_decoder("sbd", block_size=args.block, policy="threshold", gamma=0.9)
        block[f"sbd b={args.block} τ=0.9 (prefix only)"] = prefix_only
        model = load_model(args.sbd, precision=config.precision())
        for label, result in compare(model, task, block, examples, **options).items():
            rows.append({**result_row(result, task=task_name, model=Path(args.sbd).name, decoder=label),
                         "rouge_l": round(100 * result.score, 2)})  # fmt: skip
        for path in args.setdlm.split(","):
            sets = {
                f"setdlm w={w} p={math.inf if w == 1 else args.threshold:g} suffix {mode}": build_decoder(
                    "setdlm", window=w, threshold=math.inf if w == 1 else args.threshold, suffix_cache=mode
                )
                for w in windows
                for mode in ("upfront", "promote")
            }
            model = load_model(path, precision=config.precision())
            for label, result in compare(model, task, sets, examples, **options).items():
                rows.append({**result_row(result, task=task_name, model=Path(path).name, decoder=label),
                             "rouge_l": round(100 * result.score, 2)})  # fmt: skip
        log(f"{task_name} done ({time.perf_counter() - started:.0f} s)")
    columns = [("task", "task", str), *result_columns("model", "decoder", "exact", "rouge_l", "nfe_mean", "tpf", "tps")]
    print(format_table(rows, columns))
    checks = []
    for task_name in args.tasks.split(","):
        mine = [r for r in rows if r["task"] == task_name]
        sets = [r for r in mine if r["decoder"].startswith("setdlm")]
        blocks = [r for r in mine if r["decoder"].startswith("block diffusion")]
        for b in blocks:  # each block diffusion row against the setdlm rows at no more forwards
            fair = [s for s in sets if s["nfe_mean"] <= b["nfe_mean"] + 1e-9]
            best = max(fair, key=lambda r: (r["accuracy"], r["rouge_l"]), default=None)
            checks.append(
                {
                    "target": f"{task_name}: setdlm above {b['decoder']} at <= its NFE and >= its tokens/s",
                    "block": [b["accuracy"], b["rouge_l"], b["nfe_mean"], b["tps"]],
                    "setdlm": None
                    if best is None
                    else [
                        best["decoder"],
                        best["accuracy"],
                        best["rouge_l"],
                        best["nfe_mean"],
                        best["tps"],
                    ],  # fmt: skip
                    "met": best is not None and best["accuracy"] > b["accuracy"] and best["tps"] >= b["tps"],
                }
            )
    for check in checks:
        log(f"  [{'met' if check['met'] else 'NOT met'}] {check['target']}: block {check['block']}, "
            f"setdlm {check['setdlm']}")  # fmt: skip
    report = {
        "args": vars(args),
        "rows": rows,
        "checks": checks,
        "seconds": round(time.perf_counter() - started, 1),
        "threads": threads,
        "load_average_before": load_before,
        "machine": machine_info(load=True),
    }
    log(f"wrote {write_json(Path(args.results) / 'infill_vs_block.json', report)}")


if __name__ == "__main__":
    main()
