"""Compiled steps whose kernels are called from C++ (inductor's `cpp_wrapper`, fastforward's default on a
CPU) against the same graphs called from Python, interleaved in one process.

Two copies of SmolLM2-135M at int4 `--exact`, each compiled in this process (nothing read from or kept in
the store, so that neither reuses the other's graphs): one with `fastforward.cpu.compiled.cpu_wrapper`'s
options, one with inductor's Python wrapper. Each decoder then decodes the same chat prompts with each
model, in alternating order, `--rounds` times; the first round includes compiling the decoder's kinds
of step and is left out of the ratios. Prints tokens/s per round, the ratios, whether the tokens are the
same, and the load average; writes JSON.

`--profile`: after the rounds, each model's `ar` on one prompt under torch's profiler: milliseconds a token
in the int4 kernel, the graph's own code (its fused kernels and, with the Python wrapper, the interpreter
between calls), the eager-rounding `mean` and the exact attention.

`--compile-time`: instead, the seconds to compile `ar`'s one kind of step (the first two tokens of a
prompt), each wrapper in a process of its own with an empty inductor cache: the Python wrapper, the C++
wrapper with its kernels built apart (the default), and the C++ wrapper built as one file.

    python benchmarks/cpp_wrapper.py                       # ar and lookup, 8 rounds, about 10 minutes
    python benchmarks/cpp_wrapper.py --compile-time        # about 6 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import CHAT, RESULTS, load_average, log, set_threads, write_report

from fastforward.api import build_decoder
from fastforward.cpu import compiled
from fastforward.model import Model, load_model

# wrapper -> inductor's options for it
WRAPPERS = {
    "python": {"cpp_wrapper": False},
    "cpp": compiled.cpu_wrapper(torch.device("cpu")),
    "cpp-one-file": {"cpp_wrapper": True, "cpp_wrapper_build_separate": False},
}


def compiled_model(wrapper: str) -> Model:
    """SmolLM2-135M int4 `--exact` with compiled steps kept in this process, called by `wrapper`."""
    model = load_model("smollm2-135m", dtype="float32", quantize="int4", exact=True)
    model.compile_steps(None)
    model.compiled_forward.backend = compiled.inductor_backend(model.device, **WRAPPERS[wrapper])
    return model


def compile_seconds(wrapper: str) -> float:
    """Seconds to compile `ar`'s kind of step with `wrapper`, in a new process with an empty inductor cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, __file__, "--time-one-compile", wrapper],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return float(out.stdout.strip().splitlines()[-1])


def time_one_compile(wrapper: str) -> None:
    model = compiled_model(wrapper)
    prompt = model.encode_prompt(CHAT[0])
    start = time.perf_counter()
    build_decoder("ar").generate(model, [prompt], max_new_tokens=2)
    print(round(time.perf_counter() - start, 1))


# what the profile reports: label -> the profiler's event name
PROFILED = {
    "int4 kernel": "fastforward::w4a8_linear",
    "graph's own code": "## Call CompiledFxGraph",
    "mean": "aten::mean",
    "exact attention": "fastforward::exact_attention",
}


def profile(model: Model, prompt: list[int], max_new_tokens: int) -> dict[str, float]:
    """Milliseconds a token of `ar` on `prompt` in each of `PROFILED` (self time; `mean`: with what it calls)."""
    with torch.profiler.profile() as profiler:
        generation = build_decoder("ar").generate(model, [prompt], max_new_tokens=max_new_tokens)[0]
    events = profiler.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shares = {"all": total}
    for label, name in PROFILED.items():
        matched = [e for e in events if e.key.startswith(name)]
        shares[label] = sum(e.cpu_time_total if label == "mean" else e.self_cpu_time_total for e in matched)
    return {label: round(us / 1000 / generation.stats.tokens, 3) for label, us in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoders", nargs="+", default=["ar", "lookup"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="chat prompts a round")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="profile one `ar` prompt on each model (see above)")
    parser.add_argument("--compile-time", action="store_true", help="time compiling instead (see above)")
    parser.add_argument("--time-one-compile", choices=list(WRAPPERS), help=argparse.SUPPRESS)  # the child
    parser.add_argument("--out", type=Path, default=RESULTS / "cpp_wrapper.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    if args.time_one_compile:
        return time_one_compile(args.time_one_compile)
    before = load_average()
    if args.compile_time:
        seconds = {wrapper: compile_seconds(wrapper) for wrapper in WRAPPERS}
        log(f"seconds to compile ar's kind of step, empty inductor cache: {seconds}")
        return write_report(args.out.with_name("cpp_wrapper_compile.json"), before, threads, compile_seconds=seconds)
    models = {"python": compiled_model("python"), "cpp": compiled_model("cpp")}
    prompts = [models["cpp"].encode_prompt(question) for question in CHAT[: args.n]]
    rows = []
    for name in args.decoders:
        decoder = build_decoder(name)
        rates: dict[str, list[float]] = {"python": [], "cpp": []}
        tokens: dict[str, list[list[int]]] = {"python": [], "cpp": []}
        for round_ in range(args.rounds):
            for wrapper in ("python", "cpp") if round_ % 2 == 0 else ("cpp", "python"):
                model, count, start = models[wrapper], 0, time.perf_counter()
                for prompt in prompts:
                    generation = decoder.generate(model, [prompt], max_new_tokens=args.max_new_tokens)[0]
                    count += generation.stats.tokens
                    if round_ == 0:
                        tokens[wrapper].append(generation.token_ids)
                rates[wrapper].append(count / (time.perf_counter() - start))
        ratios = [c / p for p, c in zip(rates["python"][1:], rates["cpp"][1:], strict=True)]
        row = {
            "decoder": name,
            "python_tok_s": [round(r, 1) for r in rates["python"]],
            "cpp_tok_s": [round(r, 1) for r in rates["cpp"]],
            "ratios": [round(r, 3) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 3),
            "same_tokens": tokens["python"] == tokens["cpp"],
        }
        log(row)
        rows.append(row)
    print("| decoder | Python wrapper tok/s | C++ wrapper tok/s | C++ / Python (median, range) | same tokens |")
    print("|---|---|---|---|---|")
    for row in rows:
        py, cpp = statistics.median(row["python_tok_s"][1:]), statistics.median(row["cpp_tok_s"][1:])
        low, high = min(row["ratios"]), max(row["ratios"])
        print(
            f"| `{row['decoder']}` | {py:.1f} | {cpp:.1f} | {row['median_ratio']:.3f} ({low:.3f}-{high:.3f}) "
            f"| {row['same_tokens']} |"
        )
    profiles = {w: profile(m, prompts[0], args.max_new_tokens) for w, m in models.items()} if args.profile else {}
    for wrapper, shares in profiles.items():
        log(f"{wrapper} wrapper, ms a token: {shares}")
    write_report(args.out, before, threads, rows=rows, profile_ms_per_token=profiles)


if __name__ == "__main__":
    main()
