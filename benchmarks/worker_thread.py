"""Decoding on a worker thread, as the engine and `serve` decode: with one OpenMP pool, and with two.

`ar` on SmolLM2-135M at generate's precision (int4 `--exact`), 128 tokens of one chat prompt, 2 threads,
in one process, eager, or with `--compile` the engine's compiled steps:

1. the model loaded on a thread that ends (`on_passing_thread`, as `serve` and `fastforward engine run`
   load), rounds on a worker thread: the only thread with OpenMP workers;
2. rounds on the main thread (whose OpenMP pool then stays);
3. rounds on a new worker thread, beside the main thread's pool: what the engine did before it loaded on
   a passing thread (libgomp stops spin-waiting once its threads outnumber the cores).

Prints each round's tokens/s and the medians; the first round of each is left out (warm-up).

    python benchmarks/worker_thread.py
    python benchmarks/worker_thread.py --compile

Writes benchmarks/results/worker_thread[_compiled].json with the load average.
"""

from __future__ import annotations

import argparse
import statistics
import threading

from common import CHAT, RESULTS, load_average, log, set_threads, write_report

from fastforward.api import build_decoder
from fastforward.cpu.threads import on_passing_thread
from fastforward.model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile", action="store_true", help="compiled steps, as the engine runs")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    threads = set_threads(2)
    before = load_average()
    model = on_passing_thread(lambda: load_model("smollm2-135m", quantize="int4", exact=True, compile=args.compile))
    prompt = model.encode_prompt(CHAT[0])
    decoder = build_decoder("ar")
    rates: dict[str, list[float]] = {}

    def rounds(where: str) -> None:
        for _ in range(args.rounds):
            stats = decoder.generate(model, [prompt], args.tokens)[0].stats
            rates.setdefault(where, []).append(round(stats.tps, 1))

    def on_worker(where: str) -> None:
        worker = threading.Thread(target=rounds, args=(where,))
        worker.start()
        worker.join()

    on_worker("worker, one pool")
    rounds("main thread")
    on_worker("worker, two pools")
    medians = {where: statistics.median(r[1:]) for where, r in rates.items()}
    for where, r in rates.items():
        log(f"{where:20s} tok/s {r}, median after the first {medians[where]:.1f}")
    name = "worker_thread_compiled.json" if args.compile else "worker_thread.json"
    write_report(RESULTS / name, before, threads, args=vars(args), rates=rates, medians=medians)


if __name__ == "__main__":
    main()
