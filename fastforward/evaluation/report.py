"""Evaluation results written out: per-example records, JSON files and plain-text tables."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastforward.evaluation.results import EvalResult


def write_records(path: str | Path, results: Sequence[EvalResult]) -> Path:
    """Per-example records of every result, one JSON object a line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for result in results:
            for record in result.records:
                f.write(json.dumps(record) + "\n")
    return path


def write_json(path: str | Path, value: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")
    return path


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, Callable[[Any], str]]]) -> str:
    """A plain-text table: columns are (header, key, formatter)."""
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append([fmt(row.get(key)) if row.get(key) is not None else "-" for _, key, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_table(results: Sequence[EvalResult]) -> str:
    """accuracy, mean score (partial credit: pycode's lines, ROUGE-L for infilling), NFE per example,
    TPF, TPS, speedup (and agreement with AR) of each result."""
    rows = [{**r.summary(), "label": r.label} for r in results]
    return format_table(
        rows,
        [
            ("decoder", "label", str),
            ("acc %", "accuracy", lambda x: f"{x:.1f}"),
            ("score", "score", lambda x: f"{x:.3f}"),
            ("NFE/ex", "nfe_mean", lambda x: f"{x:.1f}"),
            ("TPF", "tpf", lambda x: f"{x:.2f}"),
            ("queries/tok", "queries_per_token", lambda x: f"{x:.2f}"),
            ("TPS", "tps", lambda x: f"{x:.1f}"),
            ("speedup", "speedup", lambda x: f"{x:.2f}x"),
            ("same as AR %", "agree_exact", lambda x: f"{x:.1f}"),
            ("AR token match", "agree_tokens", lambda x: f"{x:.3f}"),
        ],
    )


def how_measured(results: Sequence[EvalResult]) -> str:
    """How the figures of `results` (of one `compare` setting) were measured, in one line."""
    first = results[0]
    where = f"{first.n} examples at batch {first.batch_size}"
    if first.timing is None:
        return f"every figure: {where}, interleaved with AR of the same model"
    same, timed = sum(r.timing.same_tokens for r in results), sum(r.timing.n for r in results)  # type: ignore[union-attr]
    return (
        f"accuracy, NFE, TPF: {where}; TPS and speedup: the first {first.timing.n} again at batch 1, interleaved "
        f"with AR of the same model (the same tokens at both batch sizes: {same} of {timed} outputs)"
    )
