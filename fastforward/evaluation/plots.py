"""Plots of accuracy against parallelism (TPF), written as PNG with matplotlib's Agg backend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_curves(
    path: str | Path,
    curves: dict[str, Sequence[tuple[float, float]]],
    baselines: dict[str, tuple[float, float]] | None = None,
    labels: dict[str, Sequence[Any]] | None = None,
    title: str = "accuracy vs tokens per forward",
    xlabel: str = "tokens per forward (TPF)",
    ylabel: str = "accuracy (%)",
) -> Path:
    """One line per curve of (x, y) points, each point annotated with `labels[name][i]` if given;
    baselines are single points (e.g. AR at TPF ≈ 1) drawn as stars with a dotted level line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for name, points in curves.items():
        ordered = sorted(zip(points, (labels or {}).get(name, [None] * len(points)), strict=False))
        xs = [p[0] for p, _ in ordered]
        ys = [p[1] for p, _ in ordered]
        (line,) = ax.plot(xs, ys, marker="o", label=name)
        for (x, y), text in ordered:
            if text is not None:
                ax.annotate(
                    str(text), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color()
                )
    for name, (x, y) in (baselines or {}).items():
        (point,) = ax.plot([x], [y], marker="*", markersize=12, linestyle="none", label=name)
        ax.axhline(y, color=point.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(path: str | Path, sweep, title: str | None = None, name: str | None = None) -> Path:
    """The accuracy-vs-TPF curve of a `fastforward.evaluation.evaluate.SweepResult`, with its AR baseline."""
    label = name or sweep.points[0].decoder
    aup = sweep.aup
    heading = title or f"{label}: accuracy vs TPF over {sweep.knob}" + (f" (AUP {aup:.1f})" if aup is not None else "")
    return plot_curves(
        path,
        {label: sweep.curve},
        {"ar": (sweep.baseline.tpf, sweep.baseline.accuracy)},
        {label: [f"{sweep.knob}={v}" for v in sweep.values]},
        title=heading,
    )
