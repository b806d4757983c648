import contextlib
import os

import pytest
import torch
from driving import decode

from fastforward.decoding.runtime import Session, start
from fastforward.model import Layout, visibility
from fastforward.model.tiny import tiny_model


@pytest.fixture(autouse=True, scope="session")
def _own_fastforward_home(tmp_path_factory):
    """Quantized weights the tests' loads keep and the compiled steps (`model.store`) go to a folder of the
    session. The native kernels' builds stay the machine's, whatever home a test or its subprocesses
    set: each build is named by what it is made of, so no test meets a stale one, and none builds them
    again."""
    from fastforward.cpu import native

    before = {name: os.environ.get(name) for name in ("FASTFORWARD_HOME", "TORCH_EXTENSIONS_DIR")}
    os.environ["TORCH_EXTENSIONS_DIR"] = str(native._root().parent)
    os.environ["FASTFORWARD_HOME"] = str(tmp_path_factory.mktemp("fastforward_home"))
    yield
    for name, value in before.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run several times faster on one thread than on two busy ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random llama (fp32) with a mask token and peaked predictions (no near-ties)."""
    model = tiny_model(seed=0, init_std=0.5)
    model.add_mask_token()
    return model


@pytest.fixture(scope="module")
def prompts(tiny):
    texts = ["def add(a, b):", "Tom has 3 apples", "The quick brown fox jumps over", "0"]
    return [tiny.encode_prompt(t) for t in texts]


@pytest.fixture
def cache_is_prefill(tiny):
    """check(cache, ids): the cache's first len(ids) entries equal a fresh causal prefill of `ids`
    (what an exact decoder's cache must hold); entries past them are not checked."""

    def check(cache, ids: list[int]) -> None:
        n = len(ids)
        fresh = tiny.new_cache()
        with torch.inference_mode():
            tiny.run(Layout(torch.tensor([ids]), torch.arange(n)[None], visibility.causal(n)[None]), fresh)
        assert cache.get_seq_length() >= n
        for a, b in zip(fresh.layers, cache.layers, strict=True):
            torch.testing.assert_close(b.keys[..., :n, :], a.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(b.values[..., :n, :], a.values, rtol=1e-4, atol=1e-4)

    return check


@pytest.fixture
def stop_on(tiny):
    """`with stop_on(token):` the tiny model also stops at `token` (its own stop token is kept)."""

    @contextlib.contextmanager
    def use(token: int):
        original = tiny.hf.generation_config.eos_token_id
        tiny.hf.generation_config.eos_token_id = [original, token]
        try:
            yield
        finally:
            tiny.hf.generation_config.eos_token_id = original

    return use


@pytest.fixture
def decode_and_check_cache(tiny, cache_is_prefill):
    """Decode one prompt; its cache must begin with a fresh causal prefill of prompt + output (the
    last output token is not cached yet; verified tokens past max_new_tokens may follow)."""

    def run(decoder, prompt: list[int], max_new_tokens: int) -> Session:
        with torch.inference_mode():
            session = start(tiny, [prompt], max_new_tokens)
            decode(decoder, session)
        cache_is_prefill(session.cache, prompt + session.rows[0].output[:-1])
        return session

    return run


@pytest.fixture
def cached_step():
    """step(model, cache, tokens): one causal forward of `tokens` after the cache's entries, all of
    them kept; returns the last token's logits [1, 1, V]."""

    def step(model, cache, tokens: list[int]) -> torch.Tensor:
        past = cache.get_seq_length()
        positions = torch.arange(past, past + len(tokens))[None]
        read = torch.tensor([len(tokens) - 1])
        return model.run(Layout(torch.tensor([tokens]), positions, None, read), cache)

    return step


async def _texts(jobs) -> list[str]:
    """Each engine job's streamed text, to its end (an error event fails the test)."""
    texts = []
    for job in jobs:
        text = ""
        while (event := await job.events.get()).finish_reason is None:
            text += event.delta
        assert event.error is None, event.error
        texts.append(text)
    return texts


@pytest.fixture
def job_texts():
    """`await job_texts(jobs)`: each engine job's streamed text, to its end."""
    return _texts


@pytest.fixture
def serve_at_once(tiny):
    """serve(server, bodies, budget, **engine_options): submit the requests together (the worker wakes
    to all of them at once) to an engine of `server`'s metrics; their texts. `inside(engine)` runs
    while they are being submitted (say, a submit that must be refused)."""
    import asyncio

    from fastforward.serving.engine import Engine

    def serve(server, bodies, budget: int, inside=None, **options) -> list[str]:
        async def run() -> list[str]:
            engine = Engine(tiny, metrics=server.metrics, **({"max_batch_size": 8} | options))
            jobs = []
            with engine._lock:
                for body in bodies:
                    jobs.append(server.job(body, tiny.encode_prompt(body.prompt, chat_template=False), budget))
                    engine.submit(jobs[-1])
                if inside is not None:
                    inside(engine)
            texts = await _texts(jobs)
            await asyncio.to_thread(engine.stop)
            return texts

        return asyncio.run(run())

    return serve


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _http_server(server):
    """`with http_server(server) as url:` the server's app under uvicorn on loopback, in a thread."""
    import threading
    import time

    import uvicorn

    runner = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    for _ in range(200):
        if runner.started:
            break
        time.sleep(0.05)
    assert runner.started
    try:
        yield f"http://127.0.0.1:{runner.config.port}"
    finally:
        runner.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def free_port():
    """free_port(): a port nobody listens on, on loopback."""
    return _free_port


@pytest.fixture(scope="session")
def http_server():
    """`with http_server(server) as url:` a `fastforward.serving.app.Server` on loopback, in a thread."""
    return _http_server


SERVED_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
SERVED_TEMPLATE += "{% if add_generation_prompt %}<a>{% endif %}"


@pytest.fixture(scope="module")
def served(tiny, http_server):
    """(server, url): the tiny model served with `ar` on loopback, with a small chat template."""
    from fastforward.serving.app import Server

    tiny.tokenizer.chat_template = SERVED_TEMPLATE
    server = Server(tiny, "tiny", "ar", {}, max_batch_size=4, max_tokens=16)
    with http_server(server) as url:
        yield server, url


@pytest.fixture
def client(served):
    """The real `openai` client of the `served` server."""
    from openai import OpenAI

    return OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def scratch_registries(monkeypatch):
    """The decoder and objective registries, complete, with what a test registers dropped after it."""
    from fastforward.decoding.decoders.registry import DECODERS
    from fastforward.training.objectives import OBJECTIVES

    for registry in (DECODERS, OBJECTIVES):
        list(registry)  # every module registered first: the copy restored afterwards lacks none
        monkeypatch.setattr(registry, "entries", dict(registry.entries))
