"""`fastforward demo` on the shipped checkpoints: every method's claim, read off one table, in minutes.

The checkpoints (`fastforward/demo/checkpoints`, trained by `fastforward.demo.zoo`'s recipe; `--retrain`
trains them again) are evaluated on the same held-out arithmetic problems, each model against AR
decoding of itself in the same run (interleaved problem by problem, `evaluate.compare`):

* NTP model: AR; Jacobi Forcing model (the NTP model after one round): AR, Jacobi and
  multi-block Jacobi (both lossless);
* SBD model: AR (its NTP mode), SBD over γ, sliding SBD (`sbd-slide`, ours: each forward a fresh
  block whose first token is the next-token head's; far more accurate than plain SBD at the same TPF
  on this model), `sbd-verified` (lossless), and SingleBD
  (`sbd`, threshold policy, small blocks) beside training-free MultiBD (`mbd`) at the same threshold;
* MultiTF model (the SBD model post-trained for MultiBD): `mbd` at that threshold;
* SetDLM model: `setdlm` (sliding window), and with each step's first token from the next-token
  prediction (`first_token_from_ntp`, ours: a run of confident masks after AR's token);
* a real model (`real_model`): SmolLM2-135M-Instruct with its shipped Jacobi Forcing adapter, AR,
  `jacobi` and `lookup`, and the base's AR and `lookup`, at `generate`'s defaults (int4, `--exact`).

Each row: accuracy, NFE per problem, TPF, TPS and wall speedup against its own model's AR. Accuracy,
NFE and TPF come from every problem decoded in batches (`DemoConfig.eval_batch_size`: the decoders
give a prompt the same tokens in any batch, docs/precision.md), TPS and wall speedup from the first
`eval_timed` problems again at batch 1, interleaved with AR; the table's header says so, and on how
many of those outputs the two batch sizes gave the same tokens. A second
table gives the AUP (accuracy under parallelism, `fastforward.decoding.metrics.aup`) of every model's
AR and of each of its decoders or sweeps (the points of a sweep together, any other decoder its one
point), all on one scale: y_max is the best accuracy among the checkpoints (the SmolLM2 rows, on
other problems, are left out of it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastforward.api import build_decoder
from fastforward.decoding.metrics import aup
from fastforward.demo import real_model
from fastforward.demo.pipeline import DemoConfig, DemoResult, labelled_rows, measure
from fastforward.evaluation.evaluate import compare
from fastforward.evaluation.plots import Mark, plot_methods
from fastforward.evaluation.report import format_table, how_measured, write_json, write_records
from fastforward.model import load_model


@dataclass(frozen=True)
class Settings:
    """The decoders of the table (the multi-block rows use small blocks: answers span several)."""

    gamma_low: float = 0.1
    gamma_high: float = 0.6
    gammas: tuple[float, ...] = (0.1, 0.35, 0.6, 1.0)
    slide_gamma: float = 0.35  # `sbd-slide`: AR's token, then a run of sure masked predictions
    block_size: int = 16
    small_block: int = 6
    buffer_size: int = 3
    add_threshold: float = 0.5
    accept_threshold: float = 0.9
    windows: tuple[int, ...] = (2, 4)
    threshold: float = 0.9
    ntp_first_window: int = 4  # `setdlm` with each step's first token from the next-token prediction
    ntp_first_threshold: float = 0.995


def _gamma(g: float) -> str:
    return f"sbd γ={g:g}"


def _gamma_of(s: Settings, label: str) -> float | None:
    """The γ of an `sbd` sweep point's label, else None."""
    return next((g for g in s.gammas if label == _gamma(g)), None)


def _window(s: Settings, w: int) -> str:
    return f"setdlm w={w} p={s.threshold:g}"


def decoders(s: Settings) -> dict[str, dict[str, Any]]:
    """Per model: label → decoder."""
    mbd = dict(buffer_size=s.buffer_size, add_threshold=s.add_threshold, accept_threshold=s.accept_threshold)
    single = f"sbd τ={s.accept_threshold:g} (block {s.small_block})"
    multi = f"mbd τ={s.accept_threshold:g} (block {s.small_block} x{s.buffer_size})"
    return {
        "ntp": {},
        "jf": {
            f"jacobi (block {s.block_size})": build_decoder("jacobi", block_size=s.block_size),
            "jacobi-mr": build_decoder("jacobi-mr", block_size=s.block_size),
        },
        "sbd": {
            **{_gamma(g): build_decoder("sbd", block_size=s.block_size, gamma=g) for g in s.gammas},
            f"sbd-slide γ={s.slide_gamma:g}": build_decoder("sbd-slide", block_size=s.block_size, gamma=s.slide_gamma),
            "sbd-verified γ=∞": build_decoder("sbd-verified", block_size=s.block_size, gamma=math.inf),
            single: build_decoder("sbd", block_size=s.small_block, policy="threshold", gamma=s.accept_threshold),
            multi: build_decoder("mbd", block_size=s.small_block, **mbd),
        },
        "multitf": {multi: build_decoder("mbd", block_size=s.small_block, **mbd)},
        "setdlm": {
            **{_window(s, w): build_decoder("setdlm", window=w, threshold=s.threshold) for w in s.windows},
            f"setdlm ntp-first w={s.ntp_first_window} p={s.ntp_first_threshold:g}": build_decoder(
                "setdlm", window=s.ntp_first_window, threshold=s.ntp_first_threshold, first_token_from_ntp=True
            ),
        },
    }


def sweeps(s: Settings) -> dict[str, tuple[str, str]]:
    """The labels of `decoders` that are points of a sweep: label → (the swept method, the point's tag)."""
    return {
        **{_gamma(g): (f"sbd, γ sweep (block {s.block_size})", f"γ={g:g}") for g in s.gammas},
        **{_window(s, w): (f"setdlm p={s.threshold:g}, window sweep", f"w={w}") for w in s.windows},
    }


MODELS = {"ntp": "NTP", "jf": "Jacobi Forcing", "sbd": "SBD", "multitf": "MultiTF", "setdlm": "SetDLM"}


def evaluate_checkpoints(
    models: Path, config: DemoConfig, settings: Settings, progress: bool = True
) -> tuple[list[dict[str, Any]], list]:
    """Rows of the table (and every EvalResult) for the checkpoints in `models` (ntp/, sbd/, ...)."""
    task = config.task()
    examples = task.examples("test", n=config.eval_examples, seed=config.seed)
    options = dict(max_new_tokens=config.max_new_tokens, chat_template=False, progress=progress, **measure(config))
    rows, results = [], []
    for name, chosen in decoders(settings).items():
        model = load_model(str(models / name), precision=config.precision())
        measured = compare(model, task, chosen, examples, desc=f"eval {MODELS[name]} model", **options)
        more, each = labelled_rows(MODELS[name], measured, lambda label: _gamma_of(settings, label))
        rows, results = rows + more, results + each
    return rows, results


def marks(rows: list[dict[str, Any]], results: list, settings: Settings) -> list[Mark]:
    """The plot's points: each row's model (the colour), its decoder, and its sweep if it is a point of one."""
    groups, out = sweeps(settings), []
    for row, result in zip(rows, results, strict=True):
        method, tag = groups.get(result.label, (row["decoder"], ""))
        out.append(Mark(row["model"], result.decoder, method, result.tpf, result.accuracy, tag))
    return out


def aup_rows(rows: list[dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    """AUP per model and method (a sweep's points together, any other decoder its own point; AR
    included), on one scale: y_max is the best accuracy among `rows`. A method whose points all have
    TPF 0 (nothing generated) is left out."""
    groups = sweeps(settings)
    y_max = max(r["accuracy"] for r in rows)
    curves: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for row in rows:
        method = groups.get(row["decoder"], (row["decoder"], ""))[0]
        curves.setdefault((row["model"], method), []).append((row["tpf"], row["accuracy"]))
    return [
        {"model": model, "method": method, "points": len(points), "aup": round(aup(points, y_max), 2)}
        for (model, method), points in curves.items()
        if all(tpf > 0 for tpf, _ in points)
    ]


def describe_checkpoints(models: Path) -> list[str]:
    """One line per checkpoint: how it was trained (from its provenance.json)."""
    lines = []
    for name in MODELS:
        path = models / name / "provenance.json"
        if not path.is_file():
            lines.append(f"  {name}: no provenance.json")
            continue
        p = json.loads(path.read_text())
        stage = p["stage"]
        base = f"from {stage['base']}" if stage["base"] else "fresh"
        lines.append(
            f"  {name}: {stage['objective']} {base}, {stage['steps']} steps at LR {stage['lr']:g} "
            f"({p['seconds'] / 60:.0f} min on {p['machine']['cores']} cores), commit {p['commit'][:9]}, "
            f"sha256 {p['sha256'][:12]}"
        )
    return lines


def real_model_rows(
    real: real_model.RealSettings, progress: bool, log: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list]:
    """The SmolLM2 rows, or none and a line saying why (no base package, no shipped adapter)."""
    if reason := real_model.unavailable():
        log(f"the SmolLM2 rows are left out: {reason}")
        return [], []
    return real_model.evaluate_real_model(real, progress)


def show(
    models: str | Path,
    out: str | Path = "runs/demo",
    config: DemoConfig | None = None,
    settings: Settings | None = None,
    json_path: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    real: real_model.RealSettings | None = None,
) -> DemoResult:
    """Evaluate the checkpoints in `models` (and with `real`, SmolLM2 and its shipped adapter), print the
    table, write table.json, records and the plot to `out`."""
    config, settings, models, out = config or DemoConfig(), settings or Settings(), Path(models), Path(out)
    log(f"fastforward demo: the checkpoints in {models}")
    for line in describe_checkpoints(models):
        log(line)
    started = time.perf_counter()
    own, own_results = evaluate_checkpoints(models, config, settings, progress)
    seconds = {"evaluate": time.perf_counter() - started}
    more: list[dict[str, Any]] = []
    measured: list = []
    if real is not None:
        started = time.perf_counter()
        more, measured = real_model_rows(real, progress, log)
        seconds["real model"] = time.perf_counter() - started
    rows, results = own + more, own_results + measured
    points = [r for r in rows if r["model"] == "SBD" and r["gamma"] is not None]
    aups = aup_rows(own, settings)  # the checkpoints' own problems and scale
    out.mkdir(parents=True, exist_ok=True)
    tables = {"rows": rows, "aup": aups}
    paths = {
        "table": str(write_json(out / "table.json", {**tables, "models": str(models), "seconds": seconds})),
        "records": str(write_records(out / "records.jsonl", results)),
        "plot": str(
            plot_methods(
                out / "sweep.png",
                marks(rows, results, settings),
                title=f"arithmetic, shipped checkpoints: accuracy vs tokens per forward (n={rows[0]['n']})",
            )
        ),
    }
    if json_path:
        paths["json"] = str(write_json(json_path, {**tables, "seconds": seconds}))
    log("")
    log(f"the checkpoints, arithmetic test set: {how_measured(own_results)}")
    if measured:
        log(f"the SmolLM2 rows (int4, --exact), other problems: {how_measured(measured)}")
    log(format_table(rows, TABLE))
    y_max = max(a["accuracy"] for a in own)
    log(f"\nAUP of the checkpoints (accuracy under parallelism; one scale, y_max = {y_max:.1f} %)")
    log(format_table(aups, AUP_TABLE))
    log(f"\nplot: {paths['plot']}   table: {paths['table']}   per-example records: {paths['records']}")
    log("time: " + ", ".join(f"{part} {t:.0f} s" for part, t in seconds.items()))
    return DemoResult(rows, points, paths, seconds)


TABLE = [
    ("model", "model", str),
    ("decoder", "decoder", str),
    ("accuracy %", "accuracy", lambda x: f"{x:.1f}"),
    ("NFE/ex", "nfe_mean", lambda x: f"{x:.1f}"),
    ("TPF", "tpf", lambda x: f"{x:.2f}"),
    ("TPS", "tps", lambda x: f"{x:.0f}"),
    ("wall vs AR", "speedup", lambda x: f"{x:.2f}x"),
]

AUP_TABLE = [
    ("model", "model", str),
    ("decoder or sweep", "method", str),
    ("points", "points", str),
    ("AUP", "aup", lambda x: f"{x:.1f}"),
]
