"""How fast `fastforward serve` refuses malformed and oversized requests, and a taken port.

    python benchmarks/refusal_latency.py                 # a tiny random model: the refusals, not the model
    python benchmarks/refusal_latency.py --model demo-jf --rounds 20

The unit tests (tests/test_serve_api.py) check where each refusal happens: an oversized body by its
declared size before it is read, a prompt too long for the context before it is tokenized, bad bytes
and JSON before any request is built. This script times them: the server on loopback in this process,
each malformed request sent --rounds times (cases interleaved), and `fastforward serve` on a port in
use, which must fail before it loads a model. Prints min / median / max seconds per case and writes
JSON (benchmarks/results/refusal_latency.json). Targets: every refusal within 1 s, the taken port
within 5 s (the bounds the unit tests once asserted).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn
from common import RESULTS, load_average, log, write_report

from fastforward.cli import main as cli
from fastforward.model import load_model
from fastforward.model.tiny import tiny_model
from fastforward.serving.app import Server

GOOD = {"model": "m", "prompt": "def add(a, b):"}
NESTED = "[" * 100_000 + "]" * 100_000
CASES = {  # name: httpx.post options
    "20 MB prompt": {"json": GOOD | {"prompt": "a" * 20_000_000}},
    "long prompt": {"json": GOOD | {"prompt": "a " * 100_000}},
    "huge max_tokens": {"json": GOOD | {"max_tokens": 10**9}},
    "invalid UTF-8": {"content": b'{"model": "m", "prompt": "\xff\xfe"}'},
    "deep JSON": {"content": ('{"model": "m", "prompt": ' + NESTED + "}").encode()},
    "not JSON": {"content": b"model=m&prompt=x"},
}
TARGETS = {"refusal": 1.0, "taken port": 5.0}


@contextlib.contextmanager
def serving(server: Server):
    """The server's app under uvicorn on a free loopback port, in a thread; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    while not runner.started and thread.is_alive():
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        runner.should_exit = True
        thread.join(10)


def taken_port_seconds() -> float:
    """Seconds for `fastforward serve` to fail on a port in use (the model named does not exist)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            code = cli(["serve", "--model", "no/such/model", "--port", str(taken.getsockname()[1]), "--no-compile"])
        seconds = time.perf_counter() - started
    assert code == 2, code
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: a tiny random one)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", type=Path, default=RESULTS / "refusal_latency.json")
    args = p.parse_args()
    model = load_model(args.model) if args.model else tiny_model(seed=0)
    load_before = load_average()
    seconds: dict[str, list[float]] = {name: [] for name in [*CASES, "taken port"]}
    with serving(Server(model, "m", "ar", {}, max_batch_size=2)) as url:
        for _ in range(args.rounds):
            for name, options in CASES.items():
                started = time.perf_counter()
                response = httpx.post(url + "/v1/completions", timeout=60, **options)
                seconds[name].append(time.perf_counter() - started)
                assert 400 <= response.status_code < 500, (name, response.status_code)
            seconds["taken port"].append(taken_port_seconds())
    print("| case | seconds min / median / max | target |\n|---|---|---|")
    met = {}
    for name, times in seconds.items():
        target = TARGETS["taken port" if name == "taken port" else "refusal"]
        met[name] = max(times) <= target
        line = f"{min(times):.3f} / {statistics.median(times):.3f} / {max(times):.3f}"
        print(f"| {name} | {line} | {target:g} s {'met' if met[name] else 'MISSED'} |")
    log(f"targets met: {sum(met.values())} of {len(met)}")
    write_report(
        args.json,
        load_before,
        torch.get_num_threads(),
        settings=vars(args) | {"json": str(args.json)},
        seconds=seconds,
        targets=TARGETS,
        met=met,
    )


if __name__ == "__main__":
    main()
