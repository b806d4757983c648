"""`fastforward demo`: the SBD paper's headline claim (Table 1), end to end, on a small CPU budget.

1. build a small llama-style model with a byte-level BPE fitted to the `arithmetic` task's text;
2. pretrain it with next-token prediction on whole problems (prompt + worked solution);
3. fine-tune two copies for the same number of steps on prompt → solution: one with NTP, one with
   the SBD loss (paper §3.1: identical setting, only the loss differs);
4. evaluate on held-out problems: the NTP model with AR decoding, the SBD model in NTP mode (AR
   decoding, paper eq. 9a) and with SBD decoding over a sweep of γ (entropy-bounded sampler), the
   low and high γ of the table being two of its points, and with `sbd-verified` decoding (whole
   blocks drafted by SBD, kept only where the model's next-token prediction agrees: lossless);
5. print a table shaped like the paper's Table 1 and write the accuracy-vs-TPF plot and JSON.

Everything lands in one directory (`runs/demo` by default): `pretrain/`, `ntp/`, `sbd/` (trainer run
directories: a killed run resumes; a finished one is reused by the next demo with the same settings),
`demo.json` (the settings of the trained models), `table.json`, `records.jsonl`, `sweep.png`.

Speedups are measured, never assumed: "NFE speedup" is TPF ÷ TPF of AR decoding of the same model,
"wall speedup" is TPS ÷ TPS of AR decoding of the same model on the same prompts, measured in the
same run with the decoders interleaved example by example at batch 1, on the first `eval_timed`
problems; accuracy, NFE and TPF come from every problem at `eval_batch_size` (`evaluate.compare`'s
`timed`; the table says how many outputs were the same at both batch sizes).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from fastforward.api import build_decoder
from fastforward.cpu.threads import auto_threads
from fastforward.decoding.decoders import Decoder
from fastforward.decoding.metrics import aup
from fastforward.errors import FastForwardError
from fastforward.evaluation.evaluate import AR, compare, sweep_label
from fastforward.evaluation.plots import Mark, plot_methods
from fastforward.evaluation.report import format_table, how_measured, write_json, write_records
from fastforward.evaluation.results import EvalResult
from fastforward.model import Model, Precision, load_model
from fastforward.model.tiny import tiny_model
from fastforward.tasks import ArithmeticTask
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import NTP, make_objective
from fastforward.training.trainer import TrainConfig, train

DEMO_SETTINGS = "demo.json"
VERIFIED = "sbd-verified"


@dataclass
class DemoConfig:
    """Everything that decides the demo's models and figures (defaults: the embedded demo)."""

    # task (fastforward.tasks.arithmetic knobs)
    min_ops: int = 2
    max_ops: int = 3
    max_number: int = 20
    max_factor: int = 5
    # model (fastforward.model.tiny)
    vocab_size: int = 512
    hidden_size: int = 192
    layers: int = 4
    heads: int = 6
    # training
    pretrain_examples: int = 20000
    pretrain_steps: int = 400
    pretrain_lr: float = 2e-3
    finetune_examples: int = 10000
    finetune_steps: int = 400
    finetune_lr: float = 2e-3
    seq_len: int = 128
    batch_size: int = 16
    min_block: int = 2
    max_block: int = 16
    ntp_weight: float = 1.0
    mixed_precision: str = "no"
    # evaluation
    eval_examples: int = 150
    block_size: int = 16
    gamma_low: float = 0.1
    gamma_high: float = 0.6
    gammas: tuple[float, ...] = (0.1, 0.35, 0.6, 1.0, 2.0)
    policy: str = "entropy"
    max_new_tokens: int = 96
    eval_batch_size: int = 32  # accuracy, NFE, TPF: every problem, this many rows to a batch
    eval_timed: int = 30  # TPS and wall speedup: the first this many again at batch 1 (0: the batched pass's)
    eval_dtype: str = "float32"
    eval_quantize: str = "none"  # fastforward.cpu.quantize: none, int8 or int4
    eval_exact: bool = False  # row-invariant attention (fastforward.cpu.attention)
    seed: int = 0

    def precision(self) -> Precision:
        """How the evaluated models compute (`load_model(..., precision=...)`)."""
        return Precision(dtype=self.eval_dtype, quantize=self.eval_quantize, exact=self.eval_exact)

    def task(self) -> ArithmeticTask:
        return ArithmeticTask(
            min_ops=self.min_ops, max_ops=self.max_ops, max_number=self.max_number, max_factor=self.max_factor
        )

    def sweep_values(self) -> list[float]:
        return sorted({*self.gammas, self.gamma_low, self.gamma_high})

    def training_part(self) -> dict[str, Any]:
        """The settings the trained models depend on (evaluation settings may change freely)."""
        names = [f.name for f in fields(self)]
        cut = names.index("eval_examples")
        return {k: v for k, v in asdict(self).items() if k in names[:cut] or k == "seed"}


PRESETS: dict[str, DemoConfig] = {
    "default": DemoConfig(),
    # a few seconds: the pipeline end to end, for tests (accuracy is meaningless at this budget)
    "smoke": DemoConfig(
        vocab_size=300,
        hidden_size=32,
        layers=1,
        heads=2,
        pretrain_examples=64,
        pretrain_steps=3,
        finetune_examples=64,
        finetune_steps=3,
        seq_len=64,
        batch_size=4,
        max_block=8,
        eval_examples=4,
        block_size=8,
        gammas=(0.0, 1.0),
        gamma_low=0.1,
        gamma_high=1.0,
        max_new_tokens=24,
    ),
}


@dataclass
class DemoResult:
    rows: list[dict[str, Any]]
    sweep: list[dict[str, Any]]
    paths: dict[str, str]
    seconds: dict[str, float] = field(default_factory=dict)


# ---- training ----------------------------------------------------------------------------------
def _train_config(config: DemoConfig, steps: int, lr: float) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        lr=lr,
        warmup=max(1, min(30, steps // 10)),
        seed=config.seed,
        mixed_precision=config.mixed_precision,
        eval_every=0,
        save_every=max(1, steps // 4),
        keep_checkpoints=1,
    )


def _finished(run: Path) -> bool:
    return (run / "config.json").exists()


def pack_records(model: Model, records: list[dict[str, str]], seq_len: int) -> PackedData:
    """Records (`text`, or `prompt` + `completion`) encoded without a chat template, packed into rows of `seq_len`."""
    examples = [encode_record(r, model.tokenizer, chat_template=False) for r in records]
    return PackedData(examples, seq_len, model.pad_token_id)


def _train(
    model: Model,
    objective,
    data: PackedData,
    config: TrainConfig,
    run: Path,
    log: Callable[[str], None],
    callback: Callable[[int, dict], None] | None = None,
) -> None:
    """Train into `run`, resuming a killed run of the same settings; any other leftover is replaced."""
    try:
        train(model, objective, data, config, run, callback=callback)
    except FastForwardError as exc:
        log(f"starting {run} afresh: {exc}")
        train(model, objective, data, config, run, callback=callback, overwrite=True)


def pretrain(config: DemoConfig, run: Path, log: Callable[[str], None] = print, callback=None) -> Model:
    """A fresh model with a tokenizer fitted to the task, trained with NTP on whole problems.

    callback(step, record) runs after every step."""
    task = config.task()
    records = task.training_records(config.pretrain_examples, seed=config.seed)
    texts = [r["prompt"] + r["completion"] for r in records]
    model = tiny_model(
        texts,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        layers=config.layers,
        heads=config.heads,
        kv_heads=config.heads,
        max_positions=max(512, 2 * config.seq_len),
        seed=config.seed,
    )
    model.name = "demo-base"
    params = sum(p.numel() for p in model.hf.parameters())
    shape = f"{config.layers} layers, hidden {config.hidden_size}, vocab {len(model.tokenizer)}"
    log(f"model: llama, {shape}, {params / 1e6:.2f}M parameters")
    data = pack_records(model, [{"text": t} for t in texts], config.seq_len)
    log(f"pretraining (NTP) on {len(texts)} problems = {len(data)} rows of {config.seq_len} tokens")
    _train(model, NTP(), data, _train_config(config, config.pretrain_steps, config.pretrain_lr), run, log, callback)
    return model


def finetune(
    config: DemoConfig,
    base: Path,
    run: Path,
    objective: str,
    log: Callable[[str], None] = print,
    callback=None,
    **options: Any,
) -> Model:
    """A copy of `base` fine-tuned on prompt → worked solution with `objective` (any objective
    name; block sizes and NTP weight from `config`, other objective options from `options`).

    callback(model, step, record) runs after every step (e.g. to snapshot the model)."""
    task = config.task()
    records = task.training_records(config.finetune_examples, seed=config.seed + 1)
    model = load_model(str(base))
    model.name = f"demo-{objective}"
    data = pack_records(model, records, config.seq_len)
    blocks = dict(min_block=config.min_block, max_block=config.max_block, ntp_weight=config.ntp_weight)
    loss = make_objective(objective, **blocks, **options)
    log(f"fine-tuning a copy of {base} with {objective.upper()} on {len(records)} problems = {len(data)} rows")
    hook = None if callback is None else (lambda step, record: callback(model, step, record))
    _train(model, loss, data, _train_config(config, config.finetune_steps, config.finetune_lr), run, log, hook)
    return model


def train_models(
    config: DemoConfig, out: Path, retrain: bool = False, log: Callable[[str], None] = print
) -> dict[str, float]:
    """Train (or reuse) out/pretrain, out/ntp, out/sbd; returns seconds spent per stage."""
    settings = out / DEMO_SETTINGS
    wanted = config.training_part()
    runs = {name: out / name for name in ("pretrain", "ntp", "sbd")}
    if not retrain and settings.exists():
        saved = json.loads(settings.read_text())
        if saved != json.loads(json.dumps(wanted)):
            changed = sorted(k for k in wanted if saved.get(k) != json.loads(json.dumps(wanted))[k])
            log(f"the models in {out} were trained with other settings ({', '.join(changed)}): training again")
            retrain = True
    elif not settings.exists() and any(_finished(r) for r in runs.values()):
        retrain = True  # models of unknown settings
    if retrain:
        for run in runs.values():
            shutil.rmtree(run, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    write_json(settings, wanted)
    seconds: dict[str, float] = {}
    steps = [
        ("pretrain", lambda: pretrain(config, runs["pretrain"], log)),
        ("ntp", lambda: finetune(config, runs["pretrain"], runs["ntp"], "ntp", log)),
        ("sbd", lambda: finetune(config, runs["pretrain"], runs["sbd"], "sbd", log)),
    ]
    for name, step in steps:
        if _finished(runs[name]) and not retrain:
            log(f"reusing {runs[name]} (--retrain to train again)")
            continue
        started = time.perf_counter()
        step()
        seconds[f"train_{name}"] = time.perf_counter() - started
    return seconds


# ---- evaluation and the table ---------------------------------------------------------------------
def table_row(model: str, result: EvalResult, gamma: float | None) -> dict[str, Any]:
    return {
        "model": model,
        "decoder": "AR" if result.decoder == "ar" else result.decoder.upper(),
        "gamma": gamma,
        "accuracy": round(result.accuracy, 2),
        "nfe": result.nfe,
        "nfe_mean": round(result.nfe_mean, 2),
        "tokens": result.tokens,
        "tpf": round(result.tpf, 3),
        "tps": round(result.tps, 2),
        "nfe_speedup": round(result.nfe_speedup or 0.0, 3),
        "speedup": round(result.speedup or 0.0, 3),
        "agree_exact": round(result.agree_exact or 0.0, 2),
        "n": result.n,
        "batch_size": result.batch_size,
        "timed_n": None if result.timing is None else result.timing.n,
        "timed_same_tokens": None if result.timing is None else result.timing.same_tokens,
    }


def labelled_rows(
    model: str, measured: dict[str, EvalResult], gamma_of: Callable[[str], float | None] = lambda label: None
) -> tuple[list[dict[str, Any]], list[EvalResult]]:
    """One `compare` call's table rows (each decoder by its label, AR as "AR") and its results, their
    records tagged with `model`."""
    rows = []
    for label, result in measured.items():
        row = table_row(model, result, gamma_of(label))
        row["decoder"] = "AR" if label == AR else label
        rows.append(row)
        for record in result.records:
            record["model"] = model
    return rows, list(measured.values())


def format_demo_table(rows: list[dict[str, Any]]) -> str:
    return format_table(
        rows,
        [
            ("model (loss)", "model", str),
            ("decoder", "decoder", str),
            ("γ", "gamma", lambda g: f"{g:g}"),
            ("accuracy %", "accuracy", lambda x: f"{x:.1f}"),
            ("NFE/ex", "nfe_mean", lambda x: f"{x:.1f}"),
            ("NFE speedup", "nfe_speedup", lambda x: f"{x:.2f}x"),
            ("wall speedup", "speedup", lambda x: f"{x:.2f}x"),
            ("TPF", "tpf", lambda x: f"{x:.2f}"),
            ("TPS", "tps", lambda x: f"{x:.0f}"),
        ],
    )


def sbd_decoders(config: DemoConfig, gammas: list[float]) -> dict[str, Decoder]:
    """SBD at each γ (labelled by `sweep_label`), and `sbd-verified` drafting whole blocks (γ = ∞)."""
    decoders: dict[str, Decoder] = {
        sweep_label("gamma", g): build_decoder("sbd", block_size=config.block_size, policy=config.policy, gamma=g)
        for g in gammas
    }
    decoders[VERIFIED] = build_decoder(VERIFIED, block_size=config.block_size, gamma=math.inf)
    return decoders


def measure(config: DemoConfig) -> dict[str, Any]:
    """`compare`'s options for how the figures are measured: the batch size and the timed problems."""
    return {"batch_size": config.eval_batch_size, "timed": config.eval_timed or None}


def evaluate_models(
    config: DemoConfig, out: Path, progress: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[EvalResult]]:
    """Table rows, sweep points, and every EvalResult (for the records file)."""
    task = config.task()
    examples = task.examples("test", n=config.eval_examples, seed=config.seed)
    options = dict(max_new_tokens=config.max_new_tokens, chat_template=False, progress=progress, **measure(config))
    ntp_model = load_model(str(out / "ntp"), precision=config.precision())
    ntp = compare(ntp_model, task, {}, examples, desc="eval NTP model: AR", **options)[AR]
    sbd_model = load_model(str(out / "sbd"), precision=config.precision())
    values = config.sweep_values()
    results = compare(
        sbd_model,
        task,
        sbd_decoders(config, values),
        examples,
        desc=f"eval SBD model: AR, SBD at {len(values)} γ, verified",
        **options,
    )
    rows = [
        table_row("NTP", ntp, None),
        table_row("SBD", results[AR], None),
        table_row("SBD", results[sweep_label("gamma", config.gamma_low)], config.gamma_low),
        table_row("SBD", results[sweep_label("gamma", config.gamma_high)], config.gamma_high),
        table_row("SBD", results[VERIFIED], None),
    ]
    points = [table_row("SBD", results[sweep_label("gamma", g)], g) for g in values]
    for result in (ntp, *results.values()):
        for record in result.records:
            record["model"] = "NTP" if result is ntp else "SBD"
    return rows, points, [ntp, *results.values()]


def sbd_sweep_aup(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> dict[str, Any]:
    """AUP (`metrics.aup`) of the SBD γ sweep, on the scale of the whole table (y_max: its best
    accuracy, so the AR rows set it); None when a point generated nothing (TPF 0)."""
    y_max = max(r["accuracy"] for r in [*rows, *points])
    curve = [(p["tpf"], p["accuracy"]) for p in points]
    value = round(aup(curve, y_max), 2) if curve and all(t > 0 for t, _ in curve) else None
    return {"sbd": value, "y_max": y_max}


def run_demo(
    out: str | Path = "runs/demo",
    config: DemoConfig | None = None,
    retrain: bool = False,
    json_path: str | Path | None = None,
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> DemoResult:
    """Train (or reuse) the demo's models, evaluate them, print the table, write plot and JSON."""
    config = config or DemoConfig()
    out = Path(out)
    threads = threads or auto_threads()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    started = time.perf_counter()
    try:
        log(f"fastforward demo → {out} ({threads} torch thread{'s' if threads > 1 else ''})")
        seconds = train_models(config, out, retrain, log)
        t0 = time.perf_counter()
        rows, points, results = evaluate_models(config, out, progress)
        seconds["evaluate"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(previous_threads)
    seconds["total"] = time.perf_counter() - started
    low, high = config.gamma_low, config.gamma_high
    swept = f"sbd ({config.policy}), γ sweep"
    sweep_aup = sbd_sweep_aup(rows, points)
    paths = {
        "table": str(
            write_json(
                out / "table.json",
                {
                    "rows": rows,
                    "sweep": points,
                    "aup": sweep_aup,
                    "config": asdict(config),
                    "seconds": seconds,
                    "threads": threads,
                },
            )
        ),
        "records": str(write_records(out / "records.jsonl", results)),
        "plot": str(
            plot_methods(
                out / "sweep.png",
                [
                    Mark("NTP", AR, "AR", rows[0]["tpf"], rows[0]["accuracy"]),
                    Mark("SBD", AR, "AR (NTP mode)", rows[1]["tpf"], rows[1]["accuracy"]),
                    *(Mark("SBD", "sbd", swept, p["tpf"], p["accuracy"], f"γ={p['gamma']:g}") for p in points),
                    Mark("SBD", VERIFIED, "sbd-verified (γ=∞)", rows[4]["tpf"], rows[4]["accuracy"]),
                ],
                title=f"arithmetic: accuracy vs tokens per forward (γ low {low:g}, high {high:g}; n={rows[0]['n']})",
            )
        ),
    }
    if json_path:
        paths["json"] = str(
            write_json(json_path, {"rows": rows, "sweep": points, "aup": sweep_aup, "seconds": seconds})
        )
    log("")
    log(f"arithmetic test set, {how_measured(results)}")
    log(format_demo_table(rows))
    log(f"AUP of the SBD γ sweep: {sweep_aup['sbd']} (y_max {sweep_aup['y_max']} %, the best accuracy in the table)")
    log(
        "SBD-VERIFIED: blocks drafted by SBD in one forward and verified by the model's own next-token "
        "prediction, so its output is the SBD model's AR output"
    )
    log(f"\nplot: {paths['plot']}   table: {paths['table']}   per-example records: {paths['records']}")
    log(
        f"time: {seconds['total']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items() if k != "total")
        + ")"
    )
    return DemoResult(rows, points, paths, seconds)
