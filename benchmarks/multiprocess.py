"""One process against a torchrun launch of two, for every objective: the same model, and tokens/s.

For each objective a small random llama (fp32) is trained for `--steps` steps from the same start:
by `torchrun --nproc_per_node 2 -m fastforward train` with `--batch-size B/2` per process and the
cores shared out (one thread each on 2 cores), and by `fastforward train` in one process with
`--batch-size B`, once per thread count of `--threads` (default: 1 and all the cores). Reports the
largest difference between the final weights of the two-process run and of the one-process run with
the most threads (the trainer promises the same model up to float summation order), and each run's
tokens/s (median over the steps after the first, from its metrics.jsonl; start-up excluded). Jacobi Forcing
trains on the model's own trajectories (random drafts, random noise schedule, so that it draws).

    python benchmarks/multiprocess.py                    # the figures quoted in docs/results.md

Writes benchmarks/results/multiprocess.json with the machine and its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, load_average, log, write_report
from safetensors.torch import load_file

from fastforward.model.tiny import tiny_model
from fastforward.training.objectives import OBJECTIVES
from fastforward.training.trajectories.writer import collect

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Tom has 3 apples and buys 5 more. 3 + 5 = 8\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "A train leaves at 3 and arrives at 7, so the trip takes 7 - 3 = 4 hours.\n",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command: list[str], threads: int) -> None:
    """Run a training command with `threads` OpenMP threads per process; its output is kept on failure."""
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def tokens_per_s(out: Path) -> float:
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in steps[1:] if r["split"] == "train")


def compare(work: Path, objective: str, args: argparse.Namespace, cores: int) -> dict:
    """Train `objective` in two processes (the cores shared out) and in one (each of `args.threads`); the figures."""
    data = (
        "--trajectories=" + str(work / "t.jsonl")
        if objective == "jacobi_forcing"
        else "--data=" + str(work / "d.jsonl")
    )
    common = ["train", f"--objective={objective}", f"--model={work / 'base'}", data, f"--steps={args.steps}"]
    common += [f"--seq-len={args.seq_len}", "--lr=1e-3", "--warmup=2", "--save-every=0"]
    common += ["--noise-schedule=random", "--noise-window=4"]  # ignored by the other objectives
    two = work / f"two-{objective}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    run([*launcher, "-m", "fastforward", *common, f"--batch-size={args.batch_size // 2}", f"--out={two}"], cores // 2)
    row = {"objective": objective, "tokens_per_s_2_processes": tokens_per_s(two)}
    for threads in sorted(args.threads):
        one = work / f"one-{objective}-{threads}"
        alone = [
            sys.executable,
            "-m",
            "fastforward",
            *common,
            f"--batch-size={args.batch_size}",
            f"--threads={threads}",
        ]
        run([*alone, f"--out={one}"], threads)
        row[f"tokens_per_s_1_process_{threads}_threads"] = tokens_per_s(one)
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    return {**row, "max_abs_weight_difference": max((a[k] - b[k]).abs().max().item() for k in a)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objectives", nargs="+", default=sorted(OBJECTIVES), choices=sorted(OBJECTIVES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step (B; each of 2 processes takes B/2)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--threads", type=int, nargs="+", default=None, help="of the one-process runs (default: 1, all)"
    )
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the random llama (4 layers)")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    if cores < 2:
        raise SystemExit("this benchmark shares the cores between 2 processes: it needs at least 2")
    args.threads = args.threads or [1, cores]
    work = Path(tempfile.mkdtemp(prefix="multiprocess-"))
    model = tiny_model(TEXTS, hidden_size=args.hidden, layers=4, heads=4, kv_heads=2)
    model.save(work / "base")
    (work / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 16))
    prompts = [t[: len(t) // 2] for t in TEXTS] * 4
    collect(model, prompts, work / "t.jsonl", block_size=8, max_new_tokens=16, init="random", progress=False)

    load_before = load_average()
    rows = []
    for objective in args.objectives:
        rows.append(row := compare(work, objective, args, cores))
        speeds = ", ".join(f"{k.removeprefix('tokens_per_s_')} {v:.0f}" for k, v in row.items() if "per_s" in k)
        log(f"{objective:15s} max |Δw| {row['max_abs_weight_difference']:.1e}   tokens/s: {speeds}")
    settings = {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "hidden", "threads")}
    write_report(Path(args.results) / "multiprocess.json", load_before, cores, settings=settings, rows=rows)


if __name__ == "__main__":
    main()
