"""The demo's real-model rows: SmolLM2-135M-Instruct and the Jacobi Forcing adapter shipped over it
(`smollm2-135m-jf-arithmetic`), at `generate`'s defaults on a CPU (int4 weights, `--exact`, each model's
own decoder), asked through the chat template, on held-out problems of the arithmetic set the adapter was
trained for (the task options in its provenance.json). Each model against its own AR, in the same run: the
adapted model's AR, its default decoder (its decoding.json: `jacobi`, lossless) and `lookup`; the base's
AR and `lookup` (it has no decoding.json: `lookup` is its default).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Any

from fastforward.api import build_decoder
from fastforward.decoding.decoders import Decoder
from fastforward.decoding.model_defaults import model_decoding_defaults
from fastforward.demo.pipeline import labelled_rows
from fastforward.evaluation.evaluate import EvalResult, compare
from fastforward.model import PRESETS, SHIPPED_ADAPTERS, load_model
from fastforward.tasks import get_task

JF_PRESET = "smollm2-135m-jf-arithmetic"
BASE = "smollm2-135m"
SERVED = {"quantize": "int4", "exact": True}  # `generate`'s defaults on a CPU
LABELS = {JF_PRESET: "SmolLM2-135M JF (int4)", BASE: "SmolLM2-135M (int4)"}


@dataclass(frozen=True)
class RealSettings:
    """How many held-out problems, the longest answer (the base model rambles), and how they are measured
    (`compare`'s batch size and timed problems)."""

    n: int = 10  # the demo's budget: about 70 s for the five rows on 2 cores
    max_new_tokens: int = 128
    batch_size: int = 1
    timed: int | None = None


def unavailable() -> str | None:
    """Why the rows cannot run here (the shipped adapter or the base's GGUF package is missing), or None."""
    if not (SHIPPED_ADAPTERS / JF_PRESET / "provenance.json").is_file():
        return f"the adapter {JF_PRESET} is not in this tree"
    package, _, install = PRESETS[BASE]
    if importlib.util.find_spec(package) is None:
        return f"the base model's package is not installed (`{install}`)"
    return None


def task_options() -> dict[str, Any]:
    """The arithmetic task's options the adapter was trained and measured on (from its provenance)."""
    return json.loads((SHIPPED_ADAPTERS / JF_PRESET / "provenance.json").read_text())["task"]["options"]


def evaluate_real_model(settings: RealSettings, progress: bool = True) -> tuple[list[dict[str, Any]], list[EvalResult]]:
    """Rows of the demo's table (and every EvalResult) for the adapted model and its base."""
    task = get_task("arithmetic", **task_options())
    examples = task.examples("test", n=settings.n, seed=1)
    rows, results = [], []
    for name in (JF_PRESET, BASE):
        decoders = decoders_of(name)
        model = load_model(name, **SERVED)
        measured = compare(model, task, decoders, examples, max_new_tokens=settings.max_new_tokens,
                           batch_size=settings.batch_size, timed=settings.timed, chat_template=True,
                           progress=progress, desc=f"eval {LABELS[name]}")  # fmt: skip
        more, each = labelled_rows(LABELS[name], measured)
        rows, results = rows + more, results + each
    return rows, results


def decoders_of(name: str) -> dict[str, Decoder]:
    """A model's rows beside its AR, by label: its own default decoder (its decoding.json), then `lookup`
    (`generate`'s default where a model has none)."""
    own = model_decoding_defaults(name)
    chosen = {own.describe(): build_decoder(own.decoder, **own.options)} if own else {}
    return {**chosen, "lookup": build_decoder("lookup")}
