"""Issue 61's figures: `fastforward generate` answered by a warm engine (`fastforward engine start`)
against llama.cpp on the same GGUF (SmolLM2-135M, the defaults: int4 `--exact`, compiled steps).

Three parts, each of whole processes (start to exit) or requests interleaved A B A B over `--rounds`:

- one-shot: the README's `generate` of `--new-tokens` tokens, a client of the warm engine, against
  llama.cpp's whole one-shot (`common.LLAMA_ONE_SHOT`). Target: ours ≤ llama.cpp's (medians).
- steady state: each held-out prompt (`common.CHAT` questions, `pycode` test problems) through the
  engine with each `--decoders` entry (`generate --json`: the engine's own tokens/s, prefill included),
  paired with llama.cpp on the same prompt ids in this process. Targets: `ar` ≥ 1.5× llama.cpp on both
  groups; the best lossless decoder on code ≥ 2× (median of per-prompt ratios).
- cold path: with no engine running, `generate` (which looks for one, then decodes in process) against
  `generate --no-engine` (today's path). Target: no slower (median ratio ≤ 1.05, the noise of such runs).

The engine is started (and compiled, minutes the first time) before the timed parts and stopped after;
an engine already running for the same model and precision is refused, so stop yours first. Run it on a
quiet machine: the load average before and after is recorded beside the figures.

    python benchmarks/engine_one_shot.py
    python benchmarks/engine_one_shot.py --rounds 3 --n 4 --decoders ar lookup

Writes benchmarks/results/engine_one_shot.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import (
    CHAT,
    LLAMA_ONE_SHOT,
    ONE_SHOT_PROMPT,
    RESULTS,
    load_average,
    log,
    preset_llama_cpp,
    print_targets,
    timed,
    write_report,
)

from fastforward.model import load_model
from fastforward.tasks import get_task

LOSSLESS = ("ar", "lookup", "jacobi")  # greedy AR's tokens on an untrained model
THREADS = 2  # the engine's and llama.cpp's (`common.LLAMA_ONE_SHOT` too)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved pairs of each timed part")
    parser.add_argument("--new-tokens", type=int, default=50, help="tokens of the one-shot runs")
    parser.add_argument("--steady-tokens", type=int, default=128, help="tokens of each steady-state prompt")
    parser.add_argument("--n", type=int, default=8, help="prompts per group (chat, pycode) in the steady state")
    parser.add_argument(
        "--decoders", nargs="+", default=list(LOSSLESS), help="decoders of the steady state (ar among them)"
    )
    args = parser.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit("llama-cpp-python is not installed: pip install -e '.[bench]'")
    fastforward = str(Path(sys.executable).with_name("fastforward"))
    load_before = load_average()

    def generate(*flags: str) -> list[str]:
        return [fastforward, "generate", "--json", *flags]

    cold = paired(
        {
            "generate, no engine running": generate("--max-new-tokens", str(args.new_tokens), ONE_SHOT_PROMPT),
            "generate --no-engine": generate("--no-engine", "--max-new-tokens", str(args.new_tokens), ONE_SHOT_PROMPT),
        },
        args.rounds,
    )
    # The engine and llama.cpp at 2 threads (the engine's own default picks the cores not busy at its start).
    subprocess.run([fastforward, "engine", "start", "--wait", "--threads", str(THREADS)], check=True)
    try:
        one_shot = paired(
            {
                "generate, warm engine": generate("--max-new-tokens", str(args.new_tokens), ONE_SHOT_PROMPT),
                "llama.cpp one-shot": [sys.executable, "-c", LLAMA_ONE_SHOT, ONE_SHOT_PROMPT, str(args.new_tokens)],
            },
            args.rounds,
        )
        steady = steady_state(generate, args)
    finally:
        subprocess.run([fastforward, "engine", "stop"], check=True)
    checks = targets(cold, one_shot, steady)
    print_targets(checks, details=True)
    write_report(
        RESULTS / "engine_one_shot.json",
        load_before,
        THREADS,
        args=vars(args),
        cold=cold,
        one_shot=one_shot,
        steady=steady,
        targets=checks,
    )


def paired(commands: dict[str, list[str]], rounds: int) -> dict[str, dict]:
    """Each command's wall seconds over `rounds` interleaved runs (A B A B ...) and their median."""
    walls: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            walls[name].append(round(timed(command)[0], 3))
    for name, values in walls.items():
        log(f"{name:40s} median {statistics.median(values):.2f} s over {values}")
    return {name: {"walls": values, "median": statistics.median(values)} for name, values in walls.items()}


def steady_state(generate, args: argparse.Namespace) -> dict[str, dict]:
    """Per group and decoder: each prompt's tokens/s through the engine over llama.cpp's on the same
    prompt, requests interleaved with llama.cpp's runs."""
    model = load_model("smollm2-135m")  # llama.cpp's prompt ids and stop tokens, as `cpu_speed.py`
    llama = preset_llama_cpp(threads=THREADS)
    assert llama is not None
    texts = {"chat": CHAT[: args.n], "pycode": [ex.prompt for ex in get_task("pycode").examples("test", n=args.n)]}
    out: dict[str, dict] = {}
    for group, prompts in texts.items():
        ratios: dict[str, list[float]] = {name: [] for name in args.decoders}
        for prompt in prompts:
            for decoder in args.decoders:
                flags = ("--decoder", decoder, "--max-new-tokens", str(args.steady_tokens), prompt)
                ours = json.loads(timed(generate(*flags))[1].strip().splitlines()[-1])["stats"]["tps"]
                theirs = llama.generate(model, [model.encode_prompt(prompt)], args.steady_tokens)[0].stats.tps
                ratios[decoder].append(round(ours / theirs, 3))
        out[group] = {name: {"ratios": r, "median": statistics.median(r)} for name, r in ratios.items()}
        log(f"{group}: " + ", ".join(f"{name} {v['median']:.2f}x" for name, v in out[group].items()))
    return out


def targets(cold: dict, one_shot: dict, steady: dict) -> list[dict]:
    ours, theirs = one_shot["generate, warm engine"]["median"], one_shot["llama.cpp one-shot"]["median"]
    looked = cold["generate, no engine running"]["median"] / cold["generate --no-engine"]["median"]
    ar = {group: round(decoders["ar"]["median"], 3) for group, decoders in steady.items()}
    best_code = max((v["median"] for name, v in steady["pycode"].items() if name in LOSSLESS), default=0.0)
    return [
        {"target": "one-shot with a warm engine ≤ llama.cpp's one-shot", "met": ours <= theirs, "s": [ours, theirs]},
        {"target": "ar ≥ 1.5× llama.cpp, chat and code", "met": min(ar.values()) >= 1.5, "medians": ar},
        {"target": "best lossless on code ≥ 2× llama.cpp", "met": best_code >= 2.0, "best": round(best_code, 3)},
        {"target": "the cold path no slower than --no-engine", "met": looked <= 1.05, "ratio": round(looked, 3)},
    ]


if __name__ == "__main__":
    main()
