"""`fastforward serve`: the real `openai` client against a server on loopback, batching, streaming, faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from fastforward.api import build_decoder
from fastforward.decoding.decoders.jacobi import JacobiDecoder
from fastforward.serving.app import Server

PROMPTS = ["def add(a, b):", "Tom has 3 apples", "The quick brown fox jumps over", "0", "import os", "x = [1, 2"]


def alone(tiny, prompt: str, decoder: str = "ar", chat: bool = False, n: int = 16, **knobs) -> str:
    """What `fastforward generate` prints for this prompt alone."""
    ids = tiny.encode_prompt(prompt, chat_template=chat)
    return build_decoder(decoder, **knobs).generate(tiny, [ids], n)[0].text


@pytest.mark.parametrize("decoder, knobs", [("ar", {}), ("jacobi", {"block_size": 4}), ("sbd", {"block_size": 4})])
def test_completions_equal_generate_streamed_or_not(tiny, client, decoder, knobs):
    extra = {"decoder": decoder, **knobs}
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, extra_body=extra)
        assert out.choices[0].text == alone(tiny, prompt, decoder, n=12, **knobs)
        assert out.usage.completion_tokens > 0 and out.usage.model_extra["nfe"] > 0
        assert out.usage.model_extra["queries"] >= out.usage.model_extra["nfe"]
        chunks = list(
            client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True, extra_body=extra)
        )
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_equals_generate_with_the_template(tiny, client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    assert out.choices[0].message.content == alone(tiny, "hi", chat=True, n=10)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == out.choices[0].message.content


def multi_row_steps(server: Server) -> float:
    """Decoding steps so far that ran several rows together (the step_rows histogram past its 1 bucket)."""
    samples = server.metrics.step_rows.collect()[0].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("bucket")}
    return buckets["+Inf"] - buckets["1.0"]


def test_concurrent_requests_share_batches_and_equal_generate_alone(tiny, served, client):
    """The engine's worker is held until every request is queued, so they must be decoded in shared batches."""
    server, asks = served[0], PROMPTS * 2
    engine = server.engine

    def hold() -> None:  # runs on the worker: nothing decodes until all requests wait
        with engine._lock:
            assert engine._lock.wait_for(lambda: len(engine._inbox) == len(asks), timeout=60)

    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=14, extra_body={"decoder": "jacobi"})

    before = multi_row_steps(server)
    held = engine.call(hold)
    with ThreadPoolExecutor(len(asks)) as pool:
        outs = list(pool.map(ask, asks))
    held.result()
    for prompt, out in zip(asks, outs, strict=True):
        assert out.choices[0].text == alone(tiny, prompt, "jacobi", n=14)
    assert multi_row_steps(server) > before
    text = httpx.get(served[1] + "/metrics").text
    assert "fastforward_requests_total" in text and "fastforward_tokens_per_forward_bucket" in text
    assert "fastforward_queries_total" in text


def test_stop_strings_cut_the_output(tiny, client):
    full = alone(tiny, PROMPTS[1], n=16)
    stop = full[5:7]
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, stop=[stop])
    assert out.choices[0].text == full[: full.find(stop)] and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "other", "prompt": "x"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": "x", "decoder": "nope"}, 400, "unknown decoder"),
        ({"model": "tiny", "prompt": "x", "block_size": 0, "decoder": "jacobi"}, 400, "field 'block_size'"),
        ({"model": "tiny", "prompt": "x", "temperature": -0.7, "decoder": "jacobi"}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "n": 65}, 400, "'n'"),
        ({"model": "tiny", "prompt": "word " * 5000}, 400, "context"),
        ({"prompt": "x"}, 400, "model"),
    ],
)
def test_bad_requests_get_openai_errors_and_disturb_nothing(tiny, served, client, body, status, words):
    response = httpx.post(served[1] + "/v1/completions", json=body)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="0", max_tokens=4).choices[0].text == alone(tiny, "0", n=4)


def test_malformed_json_is_a_400(served):
    response = httpx.post(
        served[1] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_a_client_leaving_mid_stream_cancels_its_row(tiny, served, client):
    before = served[0].metrics.cancelled._value.get()
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", served[1] + "/v1/completions", json=body) as response:
        next(response.iter_lines())  # the first event, then hang up
    for _ in range(100):
        if served[0].metrics.cancelled._value.get() > before:
            break
        time.sleep(0.05)
    assert served[0].metrics.cancelled._value.get() > before
    assert client.completions.create(model="tiny", prompt="0", max_tokens=4).choices[0].text == alone(tiny, "0", n=4)


def test_a_failure_inside_decoding_fails_only_its_batch(tiny, client, monkeypatch):
    def broken(self, session):
        raise RuntimeError("boom")

    monkeypatch.setattr(JacobiDecoder, "step", broken)
    response = httpx.post(
        str(client.base_url) + "completions", json={"model": "tiny", "prompt": "x", "decoder": "jacobi"}
    )
    assert response.status_code == 500 and "boom" in response.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="0", max_tokens=4).choices[0].text == alone(tiny, "0", n=4)


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(served[1] + "/health").json() == {"status": "ok"}


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(tiny, tmp_path, free_port):
    tiny.save(tmp_path / "m")
    port = free_port()
    command = [sys.executable, "-m", "fastforward", "serve", "--model", str(tmp_path / "m"), "--port", str(port)]
    command += ["--served-name", "tiny", "--dtype", "float32", "--no-compile"]  # compiling: tests/test_compiled.py
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        for _ in range(600):  # up to a minute to import and load
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None, process.stderr.read().decode()
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
            events = (line for line in response.iter_lines() if line.startswith("data:"))
            first = next(events)  # decoding: the request is in flight
            process.send_signal(signal.SIGTERM)
            events = [first, *events]
        assert response.status_code == 200 and events[-1] == "data: [DONE]"
        choices = [json.loads(line[5:])["choices"][0] for line in events[:-1]]
        assert "".join(c["text"] for c in choices) and choices[-1]["finish_reason"] in ("stop", "length")
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()


def test_staggered_requests_with_mixed_budgets_join_running_batches(tiny, served, client):
    """Continuous batching: requests arriving while another decodes join their setting's running batch,
    whatever their budgets, and each output equals `generate` alone; two decoders take turns."""
    before = multi_row_steps(served[0])
    asks = [(PROMPTS[i % len(PROMPTS)], ("ar", "jacobi")[i % 2], 4 + 3 * i) for i in range(8)]

    def ask(index: int) -> str:
        prompt, decoder, budget = asks[index]
        body = {"decoder": decoder} | ({"block_size": 3} if decoder == "jacobi" else {})
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=budget, extra_body=body)

    long = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 300, "stream": True}  # 300 tokens: it runs on
    with httpx.stream("POST", served[1] + "/v1/completions", json=long, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # decoding: the others arrive now
        with ThreadPoolExecutor(len(asks)) as pool:
            outs = list(pool.map(ask, range(len(asks))))
        text = "".join(json.loads(line[5:])["choices"][0]["text"] for line in lines if line.startswith("data: {"))
    for (prompt, decoder, budget), out in zip(asks, outs, strict=True):
        knobs = {"block_size": 3} if decoder == "jacobi" else {}
        assert out.choices[0].text == alone(tiny, prompt, decoder, n=budget, **knobs)
    assert alone(tiny, PROMPTS[2], n=300).endswith(text) and text
    assert multi_row_steps(served[0]) > before  # some steps ran several rows


def test_text_is_streamed_and_rows_ended_only_between_steps(tiny, serve_at_once, monkeypatch):
    """The worker's loop is schedule → step → postprocess: no text goes out and no row is ended from
    outside while a decoder's step runs (nothing hooks into it), and the outputs are as alone."""
    from fastforward.decoding.decoders import JacobiDecoder
    from fastforward.decoding.rows import Row
    from fastforward.decoding.text_stream import TextStream
    from fastforward.serving.app import CompletionRequest

    stepping, seen = [False], []
    step, push, finish = JacobiDecoder.step, TextStream.push, Row.finish

    def spied_step(self, session):
        stepping[0] = True
        try:
            step(self, session)
        finally:
            stepping[0] = False

    def spy(real):
        return lambda *args, **kwargs: seen.append(stepping[0]) or real(*args, **kwargs)

    monkeypatch.setattr(JacobiDecoder, "step", spied_step)
    monkeypatch.setattr(TextStream, "push", spy(push))
    monkeypatch.setattr(Row, "finish", spy(finish))
    server = Server(tiny, "tiny", "jacobi", {"block_size": 3}, max_batch_size=8)
    bodies = [CompletionRequest(model="tiny", prompt=prompt, stop=[" "]) for prompt in PROMPTS[:3]]
    texts = serve_at_once(server, bodies, 16)
    assert seen and not any(seen)
    assert texts == [alone(tiny, p, "jacobi", n=16, block_size=3).split(" ")[0] for p in PROMPTS[:3]]


def test_admission_bounds_and_a_full_queue(tiny, serve_at_once):
    """--max-batch-tokens keeps rows out until tokens in flight allow them (outputs unchanged); a full
    queue refuses with QueueFull, which the HTTP layer answers 503 with Retry-After."""
    from fastforward.serving.app import CompletionRequest
    from fastforward.serving.engine import QueueFull

    server = Server(tiny, "tiny", "jacobi", {"block_size": 3}, max_batch_size=8)

    def refused(engine) -> None:
        with pytest.raises(QueueFull):
            engine.submit(server.job(CompletionRequest(model="tiny", prompt="0"), [5], 4))

    bodies = [CompletionRequest(model="tiny", prompt=prompt) for prompt in PROMPTS[:3]]
    texts = serve_at_once(server, bodies, 20, inside=refused, max_batch_tokens=40, max_queue=3)
    assert texts == [alone(tiny, p, "jacobi", n=20, block_size=3) for p in PROMPTS[:3]]
    samples = server.metrics.step_rows.collect()[0].samples
    steps = {s.labels["le"]: s.value for s in samples if s.name.endswith("bucket")}
    assert steps["1.0"] == steps["+Inf"] > 0  # prompt + budget > 20 tokens each: one row at a time under 40


@pytest.mark.parametrize("budget, joins", [(None, [4]), (16, [2, 1, 1]), (1, [1, 1, 1, 1])])
def test_a_burst_joins_over_several_turns_within_the_prefill_budget(tiny, serve_at_once, budget, joins, monkeypatch):
    """--max-prefill-tokens: between two steps, waiting requests join while their prompts fit in it (one
    at least), in arrival order; the rest join at the next turns. Outputs are unchanged."""
    from fastforward.decoding.engine_core import EngineCore
    from fastforward.serving.app import CompletionRequest

    seen = []
    admit = EngineCore._admit
    monkeypatch.setattr(
        EngineCore, "_admit", lambda self, setting, jobs, out: seen.append(len(jobs)) or admit(self, setting, jobs, out)
    )
    prompts = PROMPTS[:4]
    assert [len(tiny.encode_prompt(p, chat_template=False)) for p in prompts] == [9, 6, 20, 1]
    server = Server(tiny, "tiny", "jacobi", {"block_size": 3}, max_batch_size=8)
    bodies = [CompletionRequest(model="tiny", prompt=prompt) for prompt in prompts]
    texts = serve_at_once(server, bodies, 12, **({"max_prefill_tokens": budget} if budget else {}))
    assert seen == joins
    assert texts == [alone(tiny, p, "jacobi", n=12, block_size=3) for p in prompts]


@pytest.mark.parametrize("decoder, knobs", [("mbd", {"block_size": 3}), ("jacobi-mr", {})], ids=["mbd", "jacobi-mr"])
def test_multi_block_decoders_batch_requests_as_alone(tiny, decoder, knobs, serve_at_once):
    """Decoders whose rows lay out forwards of their own (a buffer of blocks, recycled candidates) share
    one batch too: each request gets its output alone."""
    from fastforward.serving.app import CompletionRequest

    server = Server(tiny, "tiny", decoder, knobs, max_batch_size=8)
    bodies = [CompletionRequest(model="tiny", prompt=prompt) for prompt in PROMPTS[:3]]
    texts = serve_at_once(server, bodies, 10)
    assert texts == [alone(tiny, p, decoder, n=10, **knobs) for p in PROMPTS[:3]]


def test_a_long_request_of_one_decoder_holds_up_no_other(tiny, job_texts):
    """Requests of another decoder arriving while a long `mbd` request decodes form a batch of their
    own, which takes turns with it step by step: they finish first, each with its output alone."""
    import asyncio

    from fastforward.serving.app import CompletionRequest
    from fastforward.serving.engine import Engine

    server = Server(tiny, "tiny", "jacobi", {"block_size": 3}, max_batch_size=8)

    async def serve() -> tuple[list[str], bool]:
        engine = Engine(tiny, max_batch_size=8, metrics=server.metrics)
        long_body = CompletionRequest(model="tiny", prompt=PROMPTS[0], decoder="mbd", block_size=3)
        long = server.job(long_body, tiny.encode_prompt(PROMPTS[0], chat_template=False), 300)
        engine.submit(long)
        await long.events.get()  # decoding
        jobs = []
        for prompt in PROMPTS[1:4]:
            jobs.append(server.job(CompletionRequest(model="tiny", prompt=prompt), tiny.encode_prompt(prompt), 10))
            engine.submit(jobs[-1])
        texts = await job_texts(jobs)
        heard = [long.events.get_nowait() for _ in range(long.events.qsize())]
        still_decoding = all(event.finish_reason is None for event in heard)
        engine.cancel(long)
        await asyncio.to_thread(engine.stop)
        return texts, still_decoding

    texts, still_decoding = asyncio.run(serve())
    assert still_decoding  # the others finished first
    assert texts == [alone(tiny, p, "jacobi", chat=True, n=10, block_size=3) for p in PROMPTS[1:4]]


def test_a_full_queue_is_a_503_with_retry_after(served, monkeypatch):
    from fastforward.serving.engine import QueueFull

    def full(job):
        raise QueueFull("256 requests are waiting already")

    monkeypatch.setattr(served[0].engine, "submit", full)
    response = httpx.post(served[1] + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "busy" in response.json()["error"]["message"]


def test_replicas_on_ray_serve_answer_as_generate(tiny, tmp_path, free_port):
    """`serve --replicas 2` on a local Ray instance: Ray Serve's proxy in front of two copies of the app,
    the real `openai` client, streamed and not; SIGTERM shuts the deployment down."""
    pytest.importorskip("ray.serve", reason="the ray extra: pip install 'fastforward[ray]'")
    tiny.save(tmp_path / "m")
    port = free_port()
    command = [sys.executable, "-m", "fastforward", "serve", "--model", str(tmp_path / "m"), "--port", str(port)]
    command += ["--served-name", "tiny", "--quantize", "none", "--no-exact", "--no-compile", "--replicas", "2"]
    command += ["--cpus-per-replica", "0.5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        for _ in range(1800):  # Ray starts, then each replica imports and loads
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stderr.read().decode()
            time.sleep(0.1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=12), PROMPTS))
        assert [o.choices[0].text for o in outs] == [alone(tiny, p, n=12) for p in PROMPTS]
        stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, stream=True)
        assert "".join(c.choices[0].text for c in stream) == alone(tiny, PROMPTS[0], n=12)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()


def test_replicas_without_ray_name_the_extra(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec

    def without_ray(name, *args):
        return None if name.startswith("ray") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_ray)
    from fastforward.cli import main

    assert main(["serve", "--model", "no/such/model", "--replicas", "2"]) == 2
    assert "pip install 'fastforward[ray]'" in capsys.readouterr().err


def test_the_warm_up_serves_through_an_engine_and_says_when_decoding_fails(tiny, monkeypatch):
    from fastforward.decoding.decoders.ar import ARDecoder
    from fastforward.errors import FastForwardError
    from fastforward.serving.warm_up import warm_up

    rows_seen = []
    forward = tiny.run

    def counting(*args, **kwargs):
        rows_seen.append(args[0].tokens.shape[0] if args else None)
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny, "run", counting)
    assert warm_up(tiny, build_decoder("ar")) > 0
    assert {1, 2} <= set(rows_seen)  # alone, and with a second request joining the running batch

    async def inside_a_running_loop() -> float:  # as a Ray Serve replica's builder may call it
        return warm_up(tiny, build_decoder("ar"))

    assert asyncio.run(inside_a_running_loop()) > 0

    def broken(self, session):
        raise RuntimeError("boom")

    monkeypatch.setattr(ARDecoder, "step", broken)
    with pytest.raises(FastForwardError, match="the server's warm-up failed: decoding failed: RuntimeError: boom"):
        warm_up(tiny, build_decoder("ar"))
