"""Helpers shared by the benchmark scripts: paths, logging, thread choice, machine facts, load
average, and `transformers`' own `generate` wrapped as a fastforward decoder so it runs interleaved
with ours in `evaluate.compare`.

Every benchmark runs as `python benchmarks/NAME.py`, which puts this directory first on sys.path, so
`from common import ...` works with no path setup. Benchmarks import this module and fastforward's
public names only, never each other.

    from common import HFGenerate, machine_info
    compare(model, task, {"hf": HFGenerate(), "hf-pl": HFGenerate(prompt_lookup_num_tokens=10)}, ...)
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
import transformers

from fastforward.decoders import Decoder, Generation, Stats
from fastforward.evaluate import write_json
from fastforward.model import Model

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def log(message: str) -> None:
    print(message, flush=True)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to `threads`, or when that is 0 or None to the cores not already
    busy (`fastforward.threads.auto_threads`); returns the count."""
    from fastforward.threads import use_threads

    return use_threads(threads)


def train_missing(out: Path, stages: list, config) -> dict[str, float]:
    """Train each `fastforward.zoo.Stage` whose model is not yet in out/<name>, in order (a killed run
    resumes); returns the seconds of each stage trained now."""
    from fastforward import zoo

    seconds: dict[str, float] = {}
    for stage in stages:
        if (out / stage.name / "config.json").exists():
            log(f"reusing {out / stage.name}")
            continue
        seconds[stage.name] = round(zoo.train_stage(stage, out, config, log), 1)
    return seconds


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (the machines are shared: timings under load are noisy)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), where `platform.processor()` gives nothing."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


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

    def decode(self, session) -> None:  # not used: generate is overridden
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
