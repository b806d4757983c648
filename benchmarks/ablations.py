"""Ablations on the arithmetic models of benchmarks/sbd_vs_ntp.py (SBD paper §3.2 and §9.1).

1. The NTP loss term (paper Fig. 4 / Table 2): a third copy of the pretrained model is fine-tuned
   with the SBD loss *without* its NTP term (objective option ntp_weight=0: the term is logged, not
   trained), same steps and data. All three models are decoded in NTP mode (AR, eq. 9a) and their
   NTP loss is measured on held-out test problems (loss on the worked solutions only).
2. Reveal policies at matched TPF (paper §9.1, Figs. 12-13): on the SBD model, sweep the
   entropy-bounded sampler's γ, the confidence-proxy EB-sampler's γ and Fast-dLLM's factor f. Each
   curve's AUP is computed on one scale (y_max = the best accuracy of everything compared, AR
   included), and accuracy is interpolated at TPF = 2, 3, 4, 5 where a curve spans it.

    python benchmarks/sbd_vs_ntp.py     # first: trains the models (runs/sbd_vs_ntp)
    python benchmarks/ablations.py      # trains the no-NTP copy, then evaluates

Writes benchmarks/results/ablations.json and ablations_policies.png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from common import RESULTS, machine_info, set_threads

from fastforward.api import build_decoder
from fastforward.decoding import metrics
from fastforward.demo.pipeline import DemoConfig, finetune, pack_records
from fastforward.evaluation.evaluate import AR, compare, sweep_label
from fastforward.evaluation.plots import plot_curves
from fastforward.evaluation.report import results_table, write_json
from fastforward.model import Model, load_model
from fastforward.training.data import derive_seed
from fastforward.training.objectives import NTP

POLICY_VALUES = {
    "entropy": [0.0, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0, 2.0, 4.0],
    "confidence": [0.0, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0, 2.0, 4.0],
    "factor": [0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0],
}
MATCHED_TPF = (2.0, 3.0, 4.0, 5.0)


@torch.no_grad()
def heldout_ntp_loss(model: Model, config: DemoConfig, n: int) -> float:
    """Mean next-token cross entropy on the worked solutions of `n` test problems (token-weighted)."""
    examples = config.task().examples("test", n=n, seed=config.seed)
    records = [{"prompt": e.prompt, "completion": e.completion or ""} for e in examples]
    data = pack_records(model, records, config.seq_len)
    total, count = 0.0, 0
    for i, batch in enumerate(data.in_order(config.batch_size)):
        loss, stats = NTP().loss(model, batch, torch.Generator().manual_seed(derive_seed(0, i)))
        total += float(loss) * stats["ntp_tokens"]
        count += int(stats["ntp_tokens"])
    return total / max(count, 1)


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """Accuracy at TPF x on the curve's upper envelope by TPF order; None outside its TPF range."""
    pts = sorted(curve)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/sbd_vs_ntp", help="the run directory of benchmarks/sbd_vs_ntp.py")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--n", type=int, default=200, help="test problems per evaluation")
    p.add_argument("--dtype", default="float32", help="weights dtype for evaluation (float32, bfloat16)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip", choices=["ntp-term", "policies"], action="append", default=[])
    args = p.parse_args()
    out = Path(args.out)
    settings = out / "bench.json"
    if not settings.exists() or not (out / "sbd" / "config.json").exists():
        raise SystemExit(f"no trained models in {out}: run benchmarks/sbd_vs_ntp.py first")
    saved = json.loads(settings.read_text())
    saved.pop("snapshots", None)
    config = replace(DemoConfig(), **saved, eval_examples=args.n, eval_dtype=args.dtype)
    threads = set_threads(args.threads)
    task = config.task()
    examples = task.examples("test", n=config.eval_examples, seed=config.seed)
    options = dict(max_new_tokens=config.max_new_tokens, batch_size=config.eval_batch_size, chat_template=False)
    report: dict = {"machine": machine_info(load=True), "threads": threads, "config": asdict(config)}
    started = time.perf_counter()

    if "ntp-term" not in args.skip:
        run = out / "sbd-no-ntp"
        if not (run / "config.json").exists():
            finetune(replace(config, ntp_weight=0.0), out / "pretrain", run, "sbd")
        rows = []
        sbd_decoder = build_decoder("sbd", block_size=config.block_size, gamma=config.gamma_low)
        for name in ("ntp", "sbd", "sbd-no-ntp"):
            model = load_model(str(out / name), dtype=config.eval_dtype)
            decoders = {} if name == "ntp" else {"sbd": sbd_decoder}
            results = compare(model, task, decoders, examples, desc=f"{name}: AR", **options)
            row = {
                "model": name,
                "ntp_mode_accuracy": round(results[AR].accuracy, 2),
                "heldout_ntp_loss": round(heldout_ntp_loss(model, config, config.eval_examples), 4),
            }
            if "sbd" in results:
                row.update(sbd_accuracy=round(results["sbd"].accuracy, 2), sbd_tpf=round(results["sbd"].tpf, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
        report["ntp_term"] = {"gamma": config.gamma_low, "rows": rows}

    if "policies" not in args.skip:
        model = load_model(str(out / "sbd"), dtype=config.eval_dtype)
        decoders = {
            f"{policy} {sweep_label('v', v)}": build_decoder(
                "sbd", block_size=config.block_size, policy=policy, gamma=v
            )
            for policy, values in POLICY_VALUES.items()
            for v in values
        }
        results = compare(model, task, decoders, examples, desc="policies", **options)
        print(results_table(list(results.values())))
        ar = results[AR]
        curves = {
            policy: [
                (results[f"{policy} {sweep_label('v', v)}"].tpf, results[f"{policy} {sweep_label('v', v)}"].accuracy)
                for v in values
            ]
            for policy, values in POLICY_VALUES.items()
        }
        y_max = max([ar.accuracy] + [y for c in curves.values() for _, y in c])
        summary = {}
        for policy, curve in curves.items():
            summary[policy] = {
                "values": POLICY_VALUES[policy],
                "points": [
                    {
                        "value": v,
                        "tpf": round(t, 4),
                        "accuracy": round(a, 2),
                        "speedup": round(results[f"{policy} {sweep_label('v', v)}"].speedup, 3),
                    }
                    for v, (t, a) in zip(POLICY_VALUES[policy], curve, strict=True)
                ],
                "aup": round(metrics.aup(curve, y_max=y_max), 3) if y_max > 0 else None,
                "accuracy_at_tpf": {f"{x:g}": interpolate(curve, x) for x in MATCHED_TPF},
            }
            print(f"{policy}: AUP {summary[policy]['aup']}, accuracy at TPF {summary[policy]['accuracy_at_tpf']}")
        report["policies"] = {"ar": ar.summary(), "y_max": y_max, "curves": summary}
        plot_curves(
            Path(args.results) / "ablations_policies.png",
            curves,
            {"AR": (ar.tpf, ar.accuracy)},
            title=f"arithmetic, SBD model: reveal policies (n={ar.n})",
        )

    report["seconds"] = time.perf_counter() - started
    path = Path(args.results) / "ablations.json"
    # A --skip run keeps the other part's figures from an earlier run (each part has its own machine).
    earlier = json.loads(path.read_text()) if path.exists() else {}
    for part in ("ntp_term", "policies"):
        if part in report:
            report[part]["machine"], report[part]["seconds"] = report["machine"], report["seconds"]
        elif part in earlier:
            report[part] = {"machine": earlier.get("machine"), "seconds": earlier.get("seconds"), **earlier[part]}
    write_json(path, report)
    print(f"wrote {path} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
