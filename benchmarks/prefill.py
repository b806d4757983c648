"""Prefill time of SmolLM2-135M int4, by int4 kernel, against llama.cpp's.

The prompts of `cpu_speed.py` (chat questions, `pycode` and `humaneval` problems), each prefilled
into an empty cache by the int4 `--exact` model of `load_model`, in three ways, interleaved prompt by
prompt: "native int4", the int4 x int8 kernel of fastforward.cpu.w4a8 (what int4 uses where it builds);
"pytorch int4", every linear through PyTorch's `_weight_int4pack_mm_for_cpu`; "pytorch int4, bf16
weights", the same model inside `quantize.prefill_kernels` (what `Model.run` does for a prefill on
PyTorch's kernel, on CPUs with native bfloat16). With `llama-cpp-python` installed, llama.cpp's
prefill of the same ids (`Llama.eval`) is timed beside them. Prints the fastest of `--repeats` per
prompt, summed over each group, and writes JSON with the load average.

    python benchmarks/prefill.py          # 4 prompts per group, 3 repeats, about two minutes
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from common import RESULTS, load_average, load_smollm2, log, preset_llama_cpp, prompt_groups, set_threads, write_report

from fastforward.cpu.quantize import prefill_kernels
from fastforward.evaluation.evaluate import format_table
from fastforward.model import Model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4, help="prompts per group")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    native, aten = (load_smollm2(kernel, quantize="int4", exact=True) for kernel in ("native", "pytorch"))
    llama_cpp = preset_llama_cpp(threads)

    def ours(model: Model, prompt: list[int], dense: bool = False) -> None:
        ids = torch.tensor([prompt])
        with torch.inference_mode(), prefill_kernels() if dense else contextlib.nullcontext():
            model.hf(input_ids=ids, past_key_values=model.new_cache(), use_cache=True, logits_to_keep=1)

    contenders: dict[str, Callable[[list[int]], None]] = {
        "native int4": lambda prompt: ours(native, prompt),
        "pytorch int4": lambda prompt: ours(aten, prompt),
        "pytorch int4, bf16 weights": lambda prompt: ours(aten, prompt, dense=True),
    }
    if llama_cpp is not None:
        contenders["llama.cpp"] = lambda prompt: (llama_cpp.llm.reset(), llama_cpp.llm.eval(prompt))
    groups = prompt_groups(native, args.n)
    for run in contenders.values():  # kernels picked, buffers allocated
        run(groups["chat"][0])
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for group, prompts in groups.items():
        for prompt in prompts:
            fastest = defaultdict(lambda: float("inf"))
            for _ in range(args.repeats):
                for label, run in contenders.items():
                    started = time.perf_counter()
                    run(prompt)
                    fastest[label] = min(fastest[label], time.perf_counter() - started)
            for label, value in fastest.items():
                seconds[label][group] += value
    tokens = {group: sum(len(p) for p in prompts) for group, prompts in groups.items()}
    rows = [
        {"prefill": label, **{group: 1e3 * s / tokens[group] for group, s in by_group.items()}}
        for label, by_group in seconds.items()
    ]
    columns = [("prefill", "prefill", str)] + [(f"{g} ms/token", g, lambda v: f"{v:.3f}") for g in groups]
    log(f"prompt tokens per group: {tokens}")
    log(format_table(rows, columns))
    write_report(args.out, load_before, threads, prompt_tokens=tokens, seconds=seconds, rows=rows)


if __name__ == "__main__":
    main()
