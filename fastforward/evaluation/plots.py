"""Plots of accuracy against parallelism (TPF), written as PNG with matplotlib's Agg backend.

`plot_methods` draws methods (a decoder on a trained model, at one setting or over a sweep) so that
each reads at a glance: one colour per training recipe (the model), one marker shape per decoder
family, filled markers for lossless decoders (their output is the model's greedy AR output) and
hollow ones for lossy decoders, a line through the points of a sweep, and each model's AR accuracy
as a horizontal line in its colour, labelled beside the axes; the legend sits outside the axes.
`plot_curves` is the plain one-line-per-curve plot (e.g. accuracy against training steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastforward.decoding.decoders.registry import spec
from fastforward.errors import FastForwardError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TPF_LABEL = "tokens per forward, TPF (generated tokens / decoding forward passes)"
ACCURACY_LABEL = "accuracy (% of examples correct)"

# decoder (registry name) → family; a decoder not listed is a family of its own
FAMILIES = {
    "ar": "ar",
    "sbd": "sbd",
    "sbd-verified": "sbd",
    "jacobi": "jacobi",
    "jacobi-mr": "jacobi",
    "mbd": "mbd",
    "setdlm": "setdlm",
    "lookup": "lookup",
}
MARKERS = {"sbd": "o", "jacobi": "D", "mbd": "s", "setdlm": "^", "lookup": "P"}
SPARE_MARKERS = ("v", "X", "h", "<", ">", "p", "*")
# tab10 without its grey (grey is the legend's key colour)
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
KEY = "0.35"


@dataclass(frozen=True)
class Mark:
    """One evaluated point: `decoder` (a registry name) on the model trained by `recipe`.

    Marks with the same recipe and method are one method's sweep, joined by a line (each point
    labelled by its `tag`, e.g. "γ=0.1"); a mark whose decoder is "ar" is its model's baseline."""

    recipe: str
    decoder: str
    method: str
    tpf: float
    accuracy: float
    tag: str = ""


def family(decoder: str) -> str:
    return FAMILIES.get(decoder, decoder)


def lossless(decoder: str) -> bool:
    """The registry's word on it (False for a name the registry does not know)."""
    try:
        return spec(decoder).lossless
    except FastForwardError:
        return False


def _figure(figsize: tuple[float, float], layout: str | None = None) -> Figure:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, dpi=120, layout=layout)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _spread(ys: list[float], gap: float) -> list[float]:
    """`ys` (ascending) moved apart to at least `gap` from each other, their mean kept."""
    out = list(ys)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap)
    shift = (sum(out) - sum(ys)) / len(out) if out else 0.0
    return [y - shift for y in out]


def draw_methods(
    marks: Sequence[Mark],
    title: str = "accuracy vs tokens per forward",
    xlabel: str = TPF_LABEL,
    ylabel: str = ACCURACY_LABEL,
) -> Figure:
    """The figure of `plot_methods` (each method's data line is labelled "recipe: method")."""
    methods: dict[tuple[str, str], list[Mark]] = {}
    for m in marks:
        if family(m.decoder) != "ar":
            methods.setdefault((m.recipe, m.method), []).append(m)
    for points in methods.values():
        points.sort(key=lambda m: m.tpf)
    recipes = list(dict.fromkeys(recipe for recipe, _ in methods))
    colour = {r: COLOURS[i % len(COLOURS)] for i, r in enumerate(recipes)}
    families = list(dict.fromkeys(family(points[0].decoder) for points in methods.values()))
    spare = iter(SPARE_MARKERS * len(families))
    marker = {f: MARKERS.get(f) or next(spare) for f in families}
    baselines: dict[str, Mark] = {}
    for m in marks:
        if family(m.decoder) == "ar" and m.recipe in colour:
            baselines.setdefault(m.recipe, m)

    def glyph(points: list[Mark]) -> tuple[str, str, bool]:
        return points[0].recipe, family(points[0].decoder), lossless(points[0].decoder)

    glyphs = [glyph(points) for points in methods.values()]
    fig = _figure((11, 6), layout="constrained")
    ax = fig.add_subplot()
    for recipe, base in baselines.items():
        ax.axhline(base.accuracy, color=colour[recipe], linestyle="--", linewidth=1.3, alpha=0.85, zorder=1)
    handles, notes = [], []
    for (recipe, method), points in methods.items():
        c = colour[recipe]
        (line,) = ax.plot(
            [m.tpf for m in points],
            [m.accuracy for m in points],
            color=c,
            linestyle="-" if len(points) > 1 else "none",
            linewidth=1.6,
            marker=marker[family(points[0].decoder)],
            markersize=9,
            markeredgewidth=1.8,
            markerfacecolor=c if lossless(points[0].decoder) else "white",
            label=f"{recipe}: {method}",
            zorder=3,
        )
        handles.append(line)
        # a tag by each point of a sweep; by a single point, its method where its glyph is not unique
        ambiguous = glyphs.count(glyph(points)) > 1
        for m in points:
            text = m.tag if len(points) > 1 else (method if ambiguous else "")
            if text:
                xy = (m.tpf, m.accuracy)
                notes.append(ax.annotate(text, xy, xytext=(0, 0), textcoords="offset points", fontsize=7.5, color=c))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.08, y=0.08)
    low, high = ax.get_ylim()
    if high - low < 10:  # points all at about one accuracy: a span of 10 points around it, within -2 to 102
        low = min(max((low + high) / 2 - 5, -2.0), 92.0)
        ax.set_ylim(low, low + 10)
    _label_baselines(fig, ax, list(baselines.values()), colour)
    lossless_shown = [lossless(points[0].decoder) for points in methods.values()]
    handles += _key(
        dashed=bool(baselines),
        filled=any(lossless_shown),
        hollow=not all(lossless_shown),
        line=any(len(points) > 1 for points in methods.values()),
    )
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="model: decoder", title_fontsize=9)
    paths = [[(m.tpf, m.accuracy) for m in points] for points in methods.values()]
    _place(fig, ax, notes, paths, [base.accuracy for base in baselines.values()])
    return fig


def _label_baselines(fig: Figure, ax, baselines: list[Mark], colour: dict[str, str]) -> None:
    """Each AR line's label just right of the axes, moved apart where their accuracies are close."""
    low, high = ax.get_ylim()
    ordered = sorted(baselines, key=lambda m: m.accuracy)
    gap = (high - low) * 1.3 * (8 / 72) / (0.8 * fig.get_figheight())
    for base, y in zip(ordered, _spread([b.accuracy for b in ordered], gap), strict=True):
        ax.text(
            1.01,
            y,
            f"{base.recipe} AR {base.accuracy:.1f}%",
            transform=ax.get_yaxis_transform(),
            color=colour[base.recipe],
            fontsize=8,
            va="center",
            ha="left",
            clip_on=False,
        )


def _key(dashed: bool, filled: bool, hollow: bool, line: bool) -> list:
    """The legend's entries that say how to read the glyphs on the plot (those it shows)."""
    from matplotlib.lines import Line2D

    dot = dict(color=KEY, marker="o", linestyle="none", markersize=8, markeredgewidth=1.8)
    entries = [
        (dashed, dict(color=KEY, linestyle="--", label="dashed: that model's AR decoding (TPF 1)")),
        (filled, dict(dot, label="filled: lossless (= AR output)")),
        (hollow, dict(dot, markerfacecolor="white", label="hollow: lossy")),
        (line, dict(color=KEY, marker="o", label="line: one decoder over a sweep")),
    ]
    return [Line2D([], [], **style) for wanted, style in entries if wanted]


# where a note may stand around its point: offset (points), horizontal and vertical alignment
SPOTS = (
    (6, 4, "left", "bottom"),
    (6, -4, "left", "top"),
    (-6, 4, "right", "bottom"),
    (-6, -4, "right", "top"),
    (0, 8, "center", "bottom"),
    (0, -8, "center", "top"),
    (8, 0, "left", "center"),
    (-8, 0, "right", "center"),
)


def _overlap(a, b) -> float:
    return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))


def _place(fig: Figure, ax, notes: list, paths: list[list[tuple[float, float]]], levels: list[float]) -> None:
    """Stand each note (an annotation of a point) where it covers the least of the markers and lines
    (`paths`, in data coordinates), the horizontal lines at `levels`, the notes placed before it and
    the space outside the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    FigureCanvasAgg(fig)
    for note in notes:
        note.set_in_layout(False)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    marker, stroke = 6 * fig.dpi / 72, 1.5 * fig.dpi / 72
    taken = []
    for path in paths:
        xy = ax.transData.transform(path)
        taken += [Bbox.from_extents(x - marker, y - marker, x + marker, y + marker) for x, y in xy]
        for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:], strict=True):
            steps = int(max(abs(x1 - x0), abs(y1 - y0)) / stroke) + 1
            for t in (k / steps for k in range(steps + 1)):
                x, y = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
                taken.append(Bbox.from_extents(x - stroke, y - stroke, x + stroke, y + stroke))
    frame = ax.get_window_extent(renderer)
    for y in ax.transData.transform([(0.0, level) for level in levels])[:, 1] if levels else []:
        taken.append(Bbox.from_extents(frame.x0, y - stroke, frame.x1, y + stroke))
    for note in notes:
        costs = []
        for i, spot in enumerate(SPOTS):
            _stand(note, spot)
            box = note.get_window_extent(renderer)
            costs.append((sum(_overlap(box, t) for t in taken) + box.width * box.height - _overlap(box, frame), i, box))
        _, i, box = min(costs, key=lambda c: c[:2])
        _stand(note, SPOTS[i])
        taken.append(box)


def _stand(note, spot: tuple[float, float, str, str]) -> None:
    note.xyann = spot[:2]
    note.set_horizontalalignment(spot[2])
    note.set_verticalalignment(spot[3])


def plot_methods(
    path: str | Path,
    marks: Sequence[Mark],
    title: str = "accuracy vs tokens per forward",
    xlabel: str = TPF_LABEL,
    ylabel: str = ACCURACY_LABEL,
) -> Path:
    """Accuracy against TPF of `marks`, as a PNG: colour = recipe, marker = decoder family, filled =
    lossless, a line through a method's sweep, each model's AR as a labelled horizontal line (drawn
    for the models that have a parallel method; no AR markers); legend outside the axes."""
    return _save(draw_methods(marks, title, xlabel, ylabel), path)


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
    fig = _figure((6.4, 4.4))
    ax = fig.add_subplot()
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
    return _save(fig, path)


def plot_sweep(
    path: str | Path, sweep, title: str | None = None, name: str | None = None, model: str = "model"
) -> Path:
    """The accuracy-vs-TPF curve of a `fastforward.evaluation.results.SweepResult` (one decoder over
    a knob's values on `model`), with that model's AR baseline as a horizontal line."""
    label = name or sweep.points[0].decoder
    aup = sweep.aup
    heading = title or f"{label}: accuracy vs TPF over {sweep.knob}" + (f" (AUP {aup:.1f})" if aup is not None else "")
    base = sweep.baseline
    marks = [Mark(model, base.decoder, "AR", base.tpf, base.accuracy)] + [
        Mark(model, p.decoder, f"{label}, {sweep.knob} sweep", p.tpf, p.accuracy, f"{sweep.knob}={v}")
        for v, p in zip(sweep.values, sweep.points, strict=True)
    ]
    return plot_methods(path, marks, title=heading)
