"""Serving under load: `fastforward serve`'s scheduling against a load generator on loopback.

    python benchmarks/serve_load.py                              # the shipped JF model with jacobi
    python benchmarks/serve_load.py --model smollm2-135m --decoder lookup --quantize int4 --exact

Each scenario starts `fastforward serve` in a process of its own on 127.0.0.1, sends the same requests
(chat prompts and code prompts of mixed lengths, budgets drawn from --budgets), streams every answer
and records, per request, the time to its first text and to its end:

  one-at-a-time  one client, each request after the previous one ended
  continuous     --clients concurrent clients, continuous batching (the default engine)
  poisson R      open loop: arrivals at R requests/s (exponential gaps), continuous batching
  in process     the continuous engine driven by --clients clients in this process, without HTTP

It prints throughput (generated tokens/s), p50 and p99 time to first token and end-to-end latency,
TTFT's p99 without the opening burst (the first request of each client, sent together at the start),
the share of outputs equal to `generate` alone (lossless decoders), and the CPU seconds the server and
the load generator spent over the scenario (both share this machine's cores: a sum near cores x wall
time means the machine, not the scheduling, bounds the throughput), and writes JSON (with every
request's TTFT, in request order). Targets
(issue 34): continuous at 32 clients at least 4x one-at-a-time on the shipped JF model, p99 TTFT at
most 2x p50, every lossless output equal to `generate`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from common import CHAT, RESULTS, load_average, log, machine_info

from fastforward.api import build_decoder
from fastforward.cpu.threads import on_passing_thread
from fastforward.model import load_model
from fastforward.tasks import get_task


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo-jf", help="model to serve (default: the shipped Jacobi Forcing model)")
    p.add_argument("--decoder", default="jacobi")
    p.add_argument("--block-size", type=int, default=None, help="the decoder's block size (jacobi)")
    p.add_argument("--quantize", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--exact", action="store_true", help="row-invariant attention (with --quantize)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compiled steps, as `fastforward serve` runs by default (prepared before the timed requests)",
    )
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--budgets", type=int, nargs=2, default=(16, 64), help="smallest and largest max_tokens")
    p.add_argument("--rates", type=float, nargs="*", default=[8.0, 32.0], help="Poisson arrival rates (requests/s)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument(
        "--max-step-tokens", type=int, default=None, help="as `fastforward serve --max-step-tokens` (default: its own)"
    )
    p.add_argument(
        "--server-threads", type=int, default=None, help="the server's torch threads (default: its own choice)"
    )
    p.add_argument(
        "--skip", nargs="*", default=[], help="scenarios to leave out: one-at-a-time continuous poisson in-process"
    )
    p.add_argument("--prompts", choices=("task", "chat"), default=None, help="task problems (demo models) or chat")
    p.add_argument("--task", default="arithmetic", help="the task whose problems are prompts (--prompts task)")
    p.add_argument("--json", type=Path, default=RESULTS / "serve_load.json")
    args = p.parse_args()

    # As the server loads: on a thread that ends, so that the in-process engine's thread is the only one
    # with OpenMP workers (`on_passing_thread`).
    model = on_passing_thread(
        lambda: load_model(args.model, quantize=args.quantize, exact=args.exact, compile=args.compile)
    )
    knobs = {"block_size": args.block_size} if args.block_size else {}
    requests = workload(model, args)
    load_before = load_average()
    scenarios: dict[str, dict] = {}
    plans = [("one-at-a-time", 1, None), ("continuous", args.clients, None)]
    plans += [(f"poisson {r:g}/s", None, r) for r in args.rates]
    for name, clients, rate in plans:
        if name.split()[0] in args.skip:
            continue
        log(f"== {name}")
        results, cpu = serve(args, requests, clients, rate)
        scenarios[name] = summarize(results, burst=clients or 0) | cpu
        log(json.dumps({k: v for k, v in scenarios[name].items() if k not in ("texts", "ttft_by_request")}))
    if "in-process" not in args.skip:  # the same engine without HTTP: what the server's layer costs
        log("== continuous, in process")
        results, cpu = in_process(model, args, knobs, requests)
        scenarios["continuous, in process"] = summarize(results, burst=args.clients) | cpu
    reference = [
        build_decoder(args.decoder, **knobs).generate(model, [r["ids"]], r["budget"])[0].text for r in requests
    ]
    for record in scenarios.values():
        record["equal_to_generate"] = sum(t == ref for t, ref in zip(record.pop("texts"), reference, strict=True))
        record["requests"] = len(requests)
    report(args, scenarios, load_before)
    return 0


def workload(model, args: argparse.Namespace) -> list[dict]:
    """The requests: prompts of mixed lengths (the task's problems, or chat questions and short code
    problems), a budget each, in a fixed shuffled order. Sent to /v1/completions: no chat template."""
    kind = args.prompts or ("task" if args.model.startswith("demo-") else "chat")
    if kind == "task":
        texts = [ex.prompt for ex in get_task(args.task).examples("test", n=args.requests, seed=0)]
    else:
        texts = list(CHAT) + [ex.prompt for ex in get_task("pycode").examples("test", n=8, seed=0)]
    draw = random.Random(0)
    requests = []
    for i in range(args.requests):
        text = texts[i % len(texts)]
        ids = model.encode_prompt(text, chat_template=False)
        requests.append({"text": text, "ids": ids, "budget": draw.randint(*args.budgets)})
    draw.shuffle(requests)
    return requests


def serve(
    args: argparse.Namespace, requests: list[dict], clients: int | None, rate: float | None
) -> tuple[list[dict], dict]:
    """Start `fastforward serve` in its own process (so the load generator here takes none of its
    time), send the requests `clients` at a time or at Poisson `rate`, stop the server. Returns the
    results and the CPU seconds the server and this load generator spent while the requests ran."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "fastforward", "serve", "--model", args.model, "--served-name", "m"]
    command += ["--decoder", args.decoder, "--port", str(port), "--max-batch-size", str(args.max_batch_size)]
    command += ["--quantize", args.quantize, "--exact" if args.exact else "--no-exact"]
    command += ["--compile" if args.compile else "--no-compile"]
    command += ["--block-size", str(args.block_size)] if args.block_size else []
    command += ["--max-step-tokens", str(args.max_step_tokens)] if args.max_step_tokens else []
    command += ["--threads", str(args.server_threads)] if args.server_threads else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(6000):  # up to 10 min: a server compiles what is not kept yet before it listens
            if server.poll() is not None:
                raise RuntimeError(f"the server exited: {server.stderr.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        process, mine = psutil.Process(server.pid), time.process_time()
        before = process.cpu_times()
        results = asyncio.run(_send_all(f"http://127.0.0.1:{port}/v1/completions", requests, clients, rate))
        after = process.cpu_times()
        server_cpu = after.user + after.system - before.user - before.system
        cpu = {"server_cpu_s": round(server_cpu, 2), "load_generator_cpu_s": round(time.process_time() - mine, 2)}
        return results, cpu
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def in_process(model, args: argparse.Namespace, knobs: dict, requests: list[dict]) -> tuple[list[dict], dict]:
    """--clients clients of the continuous engine in this process, through `Engine.submit` and the
    jobs' event queues: the server without its HTTP layer (and with no load generator beside it).
    Returns the results and the CPU seconds this process (engine and clients) spent on them."""
    from fastforward.serving.app import CompletionRequest, Server
    from fastforward.serving.engine import Engine
    from fastforward.serving.warm_up import warm_up

    if args.compile:  # as the server does before it listens
        warm_up(model, build_decoder(args.decoder, **knobs))
    server = Server(model, "m", args.decoder, knobs, args.max_batch_size, max_step_tokens=args.max_step_tokens)

    async def run() -> tuple[list[dict], dict]:
        engine = Engine(model, args.max_batch_size, server.metrics, max_step_tokens=server.max_step_tokens)
        results: list[dict] = [{} for _ in requests]
        queue = list(range(len(requests)))
        started, cpu = time.perf_counter(), time.process_time()

        async def client() -> None:
            while queue:
                index = queue.pop(0)
                request = requests[index]
                body = CompletionRequest(model="m", prompt=request["text"])
                job = server.job(body, request["ids"], request["budget"])
                sent, first, text = time.perf_counter(), None, ""
                engine.submit(job)
                while (event := await job.events.get()).finish_reason is None:
                    if event.delta and first is None:
                        first = time.perf_counter() - sent
                    text += event.delta
                text += event.delta
                end = time.perf_counter() - sent
                tokens = event.usage["completion_tokens"] if event.usage else 0
                results[index] = {"ttft": first or end, "latency": end, "tokens": tokens, "text": text}

        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        await asyncio.to_thread(engine.stop)
        return [r | {"wall": wall} for r in results], {"server_cpu_s": round(cpu, 2)}

    return asyncio.run(run())


async def _send_all(url: str, requests: list[dict], clients: int | None, rate: float | None) -> list[dict]:
    results: list[dict] = [{} for _ in requests]
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        if rate is None:
            queue = list(range(len(requests)))

            async def worker() -> None:
                while queue:
                    index = queue.pop(0)
                    results[index] = await _one(client, url, requests[index])

            await asyncio.gather(*(worker() for _ in range(clients or 1)))
        else:
            gaps = random.Random(1)

            async def later(index: int, delay: float) -> None:
                await asyncio.sleep(delay)
                results[index] = await _one(client, url, requests[index])

            delay, tasks = 0.0, []
            for index in range(len(requests)):
                tasks.append(asyncio.create_task(later(index, delay)))
                delay += gaps.expovariate(rate)
            await asyncio.gather(*tasks)
    for r in results:
        r["wall"] = time.perf_counter() - started
    return results


async def _one(client: httpx.AsyncClient, url: str, request: dict) -> dict:
    body = {"model": "m", "prompt": request["text"], "max_tokens": request["budget"], "stream": True}
    sent = time.perf_counter()
    first, text, tokens = None, "", 0
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["text"]
            if delta and first is None:
                first = time.perf_counter() - sent
            text += delta
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter() - sent
    return {"ttft": first if first is not None else end, "latency": end, "tokens": tokens, "text": text}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(results: list[dict], burst: int) -> dict:
    """Throughput and percentiles of one scenario; results in request order. burst: the requests sent
    together at the start (closed loop: one per client), whose first tokens wait for each other's
    prefill: TTFT's p99 is also given without them."""
    wall = max(r["wall"] for r in results)
    ttft, latency = [r["ttft"] for r in results], [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    after = ttft[burst:] if len(ttft) > 2 * burst else ttft
    return {
        "seconds": round(wall, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50": round(statistics.median(ttft), 3),
        "ttft_p99": round(_percentile(ttft, 0.99), 3),
        "ttft_p99_after_burst": round(_percentile(after, 0.99), 3),
        "ttft_by_request": [round(t, 4) for t in ttft],
        "latency_p50": round(statistics.median(latency), 3),
        "latency_p99": round(_percentile(latency, 0.99), 3),
        "texts": [r["text"] for r in results],
    }


def report(args: argparse.Namespace, scenarios: dict[str, dict], load_before: list[float]) -> None:
    base = scenarios.get("one-at-a-time", {}).get("tokens_per_s")
    print(f"\n{args.model} with {args.decoder}, {args.requests} requests, budgets {args.budgets[0]}-{args.budgets[1]}")
    print(
        "| scenario | tokens/s | × one at a time | TTFT p50 / p99 s | TTFT p99 after the opening burst s "
        "| latency p50 / p99 s | = generate | CPU s: server / load generator |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in scenarios.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else ""
        print(
            f"| {name} | {r['tokens_per_s']} | {ratio} | {r['ttft_p50']} / {r['ttft_p99']} | "
            f"{r['ttft_p99_after_burst']} | {r['latency_p50']} / {r['latency_p99']} | "
            f"{r['equal_to_generate']}/{r['requests']} | {r['server_cpu_s']} / {r.get('load_generator_cpu_s', '-')} |"
        )
    record = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "settings": vars(args) | {"json": str(args.json)},
        "scenarios": scenarios,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    log(f"load average before {load_before}, after {record['load_average_after']}; wrote {args.json}")


if __name__ == "__main__":
    raise SystemExit(main())
