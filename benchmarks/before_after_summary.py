"""Summarise `benchmarks/before_after.sh`'s records: per round and side, the mean tokens/s of `ar` and
`lookup` at int4, each also as a multiple of plain transformers `generate` (`hf fp32`) in the same run (code
that neither side changes: when the machine slows down during a side, the multiple stays where the
tokens/s do not), the engine's tokens/s in process, and the demo's wall ratios (their geometric mean
over the non-AR rows that both sides have: a demo row added or removed between the commits is left out; the rows
whose accuracy or TPF differ, which a pure refactor leaves none of). Writes summary.json beside the records.

    python benchmarks/before_after_summary.py runs/before-after
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def side_figures(out: Path, side: str, round_: int) -> dict:
    cpu = json.loads((out / f"cpu_{side}_{round_}.json").read_text())
    serve = json.loads((out / f"serve_{side}_{round_}.json").read_text())
    demo = json.loads((out / f"demo_{side}_{round_}.json").read_text())
    rates = {}
    for label in ("hf fp32", "ar int4", "lookup int4"):
        rates[label] = statistics.mean(r["tok_s"] for r in cpu["rows"] if r["contender"] == label)
    decoded = [r for r in demo["rows"] if r["decoder"] != "AR"]
    return {
        "load_average": cpu["load_average_before"][0],
        "cpu_tok_s": {k: round(v, 1) for k, v in rates.items()},
        "cpu_vs_hf_fp32": {k: round(rates[k] / rates["hf fp32"], 2) for k in ("ar int4", "lookup int4")},
        "serve_in_process_tok_s": serve["scenarios"]["continuous, in process"]["tokens_per_s"],
        "demo_rows": {f"{r['model']} {r['decoder']}": [r["accuracy"], r["tpf"], r["speedup"]] for r in decoded},
    }


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/before-after")
    rounds = sorted({int(p.stem.rsplit("_", 1)[1]) for p in out.glob("demo_after_*.json")})
    table = {f"{side} {r}": side_figures(out, side, r) for r in rounds for side in ("before", "after")}
    for r in rounds:
        both = table[f"before {r}"]["demo_rows"].keys() & table[f"after {r}"]["demo_rows"].keys()
        for side in ("before", "after"):
            rows = table[f"{side} {r}"]["demo_rows"]
            table[f"{side} {r}"]["demo_wall_ratio_geomean"] = round(
                statistics.geometric_mean(rows[row][2] for row in sorted(both)), 3
            )
    print("side       load  hf fp32  ar int4 (x hf)  lookup int4 (x hf)  serve in process  demo wall ratio (geomean)")
    for name, f in table.items():
        rate, multiple = f["cpu_tok_s"], f["cpu_vs_hf_fp32"]
        print(
            f"{name:9} {f['load_average']:5.2f}  {rate['hf fp32']:7.1f}"
            f"  {rate['ar int4']:7.1f} ({multiple['ar int4']:.2f})"
            f"  {rate['lookup int4']:11.1f} ({multiple['lookup int4']:.2f})"
            f"  {f['serve_in_process_tok_s']:16.1f}  {f['demo_wall_ratio_geomean']:.3f}"
        )
    differ = sorted(
        {
            row
            for r in rounds
            for row, (accuracy, tpf, _) in table[f"after {r}"]["demo_rows"].items()
            if row in table[f"before {r}"]["demo_rows"]
            and table[f"before {r}"]["demo_rows"][row][:2] != [accuracy, tpf]
        }
    )
    print("demo rows whose accuracy or TPF differ between the sides:", ", ".join(differ) or "none")
    one_side = sorted(
        {
            row
            for r in rounds
            for row in table[f"after {r}"]["demo_rows"].keys() ^ table[f"before {r}"]["demo_rows"].keys()
        }
    )
    print("demo rows on one side only (left out of the ratio):", ", ".join(one_side) or "none")
    summary = {"rounds": table, "rows_that_differ": differ, "rows_on_one_side": one_side}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
