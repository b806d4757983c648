"""The demo's accuracy-vs-TPF plot reads at a glance: built from synthetic results, checked on the figure."""

from __future__ import annotations

from itertools import combinations
from types import SimpleNamespace

from matplotlib.colors import to_rgba

from fastforward.evaluation.plots import Mark, draw_methods, plot_methods, plot_sweep

MARKS = [
    Mark("NTP", "ar", "AR", 1.0, 95.0),  # AR only: nothing parallel to compare, so no line
    Mark("SBD", "ar", "AR", 1.02, 85.0),
    *(
        Mark("SBD", "sbd", "sbd γ sweep", t, a, f"γ={g:g}")
        for g, t, a in [(0.1, 2.0, 84.0), (0.5, 3.0, 70.0), (1, 4, 50)]
    ),
    Mark("SBD", "sbd-verified", "sbd-verified", 2.2, 85.0),
    Mark("SBD", "mbd", "mbd τ=0.9", 3.5, 60.0),
    Mark("Jacobi Forcing", "ar", "AR", 1.01, 85.3),  # close to SBD's AR: the two labels must not collide
    Mark("Jacobi Forcing", "jacobi", "jacobi (block 16)", 3.70, 85.3),
    Mark("Jacobi Forcing", "jacobi-mr", "jacobi-mr", 3.75, 85.3),  # same glyph, nearly the same place
    Mark("MultiTF", "mbd", "mbd τ=0.9", 3.4, 65.0),  # no AR mark: no line
]
KEY = ["dashed: that model's AR decoding (TPF 1)", "filled: lossless (= AR output)", "hollow: lossy"]


def drawn():
    fig = draw_methods(MARKS, title="synthetic")
    fig.canvas.draw()
    ax = fig.axes[0]
    horizontal = [line for line in ax.get_lines() if list(line.get_xdata()) == [0, 1]]
    data = {line.get_label(): line for line in ax.get_lines() if line not in horizontal}
    return fig, ax, horizontal, data


def test_colour_per_recipe_marker_per_family_fill_for_lossless():
    _, _, _, data = drawn()
    assert list(data) == [
        "SBD: sbd γ sweep",
        "SBD: sbd-verified",
        "SBD: mbd τ=0.9",
        "Jacobi Forcing: jacobi (block 16)",
        "Jacobi Forcing: jacobi-mr",
        "MultiTF: mbd τ=0.9",
    ]  # every method once, no AR point
    colour = {label: line.get_color() for label, line in data.items()}
    by_recipe = {
        recipe: {c for label, c in colour.items() if label.startswith(recipe + ":")}
        for recipe in ("SBD", "Jacobi Forcing", "MultiTF")
    }
    assert [len(colours) for colours in by_recipe.values()] == [1, 1, 1]
    assert len(set(colour.values())) == 3

    marker = {label: line.get_marker() for label, line in data.items()}
    assert marker["SBD: sbd γ sweep"] == marker["SBD: sbd-verified"]
    assert marker["Jacobi Forcing: jacobi (block 16)"] == marker["Jacobi Forcing: jacobi-mr"]
    assert marker["SBD: mbd τ=0.9"] == marker["MultiTF: mbd τ=0.9"]
    assert len({marker["SBD: sbd γ sweep"], marker["Jacobi Forcing: jacobi-mr"], marker["MultiTF: mbd τ=0.9"]}) == 3

    filled = {label: to_rgba(line.get_markerfacecolor()) == to_rgba(line.get_color()) for label, line in data.items()}
    assert filled == {
        "SBD: sbd γ sweep": False,
        "SBD: sbd-verified": True,
        "SBD: mbd τ=0.9": False,
        "Jacobi Forcing: jacobi (block 16)": True,
        "Jacobi Forcing: jacobi-mr": True,
        "MultiTF: mbd τ=0.9": False,
    }


def test_sweep_is_a_line_single_points_are_markers():
    _, ax, _, data = drawn()
    assert {label: (len(line.get_xdata()), line.get_linestyle()) for label, line in data.items()} == {
        "SBD: sbd γ sweep": (3, "-"),
        "SBD: sbd-verified": (1, "None"),
        "SBD: mbd τ=0.9": (1, "None"),
        "Jacobi Forcing: jacobi (block 16)": (1, "None"),
        "Jacobi Forcing: jacobi-mr": (1, "None"),
        "MultiTF: mbd τ=0.9": (1, "None"),
    }
    assert list(data["SBD: sbd γ sweep"].get_xdata()) == [2.0, 3.0, 4.0]
    # the sweep's values tag its points; the two Jacobi points (same colour, marker, fill) are named
    notes = {note.get_text() for note in ax.texts if note.get_text() and " AR " not in note.get_text()}
    assert notes == {"γ=0.1", "γ=0.5", "γ=1", "jacobi (block 16)", "jacobi-mr"}


def test_one_labelled_ar_line_per_model_with_parallel_rows():
    fig, ax, horizontal, data = drawn()
    lines = sorted((line.get_ydata()[0], line.get_color()) for line in horizontal)
    assert lines == [
        (85.0, data["SBD: sbd-verified"].get_color()),
        (85.3, data["Jacobi Forcing: jacobi-mr"].get_color()),
    ]
    labels = {t.get_text(): t for t in ax.texts if " AR " in t.get_text()}
    assert sorted(labels) == ["Jacobi Forcing AR 85.3%", "SBD AR 85.0%"]
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in labels.values()]
    frame = ax.get_window_extent(renderer)
    assert [box.x0 >= frame.x1 for box in boxes] == [True, True]  # beside the axes, not over the data
    assert not boxes[0].overlaps(boxes[1])


def test_legend_outside_the_axes_and_notes_apart():
    fig, ax, _, data = drawn()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box, frame = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert not box.overlaps(frame)
    assert (box.x0 >= 0, box.y0 >= 0, box.x1 <= fig.bbox.x1, box.y1 <= fig.bbox.y1) == (True, True, True, True)
    assert [t.get_text() for t in legend.get_texts()] == [line.get_label() for line in data.values()] + KEY + [
        "line: one decoder over a sweep"
    ]
    notes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text() and " AR " not in t.get_text()]
    assert [a.overlaps(b) for a, b in combinations(notes, 2)] == [False] * 10


def test_plot_methods_and_plot_sweep_write_pngs(tmp_path):
    assert plot_methods(tmp_path / "a.png", MARKS).read_bytes()[:4] == b"\x89PNG"
    point = SimpleNamespace(decoder="sbd", tpf=2.0, accuracy=50.0)
    sweep = SimpleNamespace(
        knob="gamma",
        values=[0.1, 1.0],
        points=[point, SimpleNamespace(decoder="sbd", tpf=3.0, accuracy=40.0)],
        baseline=SimpleNamespace(decoder="ar", tpf=1.0, accuracy=60.0),
        aup=None,
    )
    assert plot_sweep(tmp_path / "s.png", sweep, model="tiny").read_bytes()[:4] == b"\x89PNG"
