"""Serving sampled requests and streaming them cheaply: seeded requests share a batch and each gets
its tokens alone; the incremental detokenizer's deltas add up to exactly the decoded text (multi-byte
characters split across tokens included) and stop strings cut it exactly."""

import random

import pytest

from fastforward.api import build_decoder
from fastforward.decoding.text_stream import TextStream
from fastforward.model.tiny import EOS, fit_tokenizer
from fastforward.serving.app import CompletionRequest, Server

TEXTS = [
    "Un café crème, naïve Grüße. 日本語のテキスト 🙂🚀 and 👩‍💻 mixed with ASCII.",
    "Zürich → 東京: ½ price, ünïcödé everywhere; emoji 🎉🎉 at the end 😀",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with few merges, so multi-byte characters are split across tokens."""
    return fit_tokenizer(TEXTS, vocab_size=280)


def stream(tokenizer, ids: list[int], chunk: int, stop: list[str] = ()) -> tuple[list[str], bool]:
    """Push `ids` `chunk` tokens at a time (the last push final); the deltas and whether a stop ended it."""
    text = TextStream(lambda part: tokenizer.decode(part, skip_special_tokens=True), list(stop))
    deltas: list[str] = []
    for start in range(0, len(ids), chunk):
        delta, stopped = text.push(ids[start : start + chunk], final=start + chunk >= len(ids))
        deltas.append(delta)
        if stopped:
            return deltas, True
    return deltas, False


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streamed_deltas_add_up_to_the_decoded_text(tokenizer, chunk):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        ids = ids[:10] + [eos] + ids[10:]  # a special token is skipped, as decode skips it
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # characters are split across tokens
        deltas, stopped = stream(tokenizer, ids, chunk)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) and not stopped
        assert not any("\ufffd" in d for d in deltas)  # never a replacement a later token completes


def test_any_token_sequence_streams_to_its_decoded_text(tokenizer):
    """Token sequences that are not valid UTF-8 (lone continuation bytes, cut characters) still
    stream to exactly what decoding them all at once gives, replacement characters included."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        assert "".join(stream(tokenizer, ids, rng.choice([1, 2, 5]))[0]) == tokenizer.decode(
            ids, skip_special_tokens=True
        )


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_strings_cut_the_text_exactly(tokenizer, chunk):
    text = "one stop two sto three 日本 stop here, more stop"
    ids = tokenizer(text)["input_ids"]
    cases = [
        (["stop here"], text[: text.find("stop here")]),  # spans tokens; "sto" and "stop" before it are not it
        (["three", "two"], "one stop "),  # the earliest of several
        (["日本 s"], text[: text.find("日本")]),  # across multi-byte characters
        (["nowhere"], text),  # a tail that could begin one is held only until the end
        (["stop", ""], "one "),  # an empty stop string stops nothing
    ]
    for stop, expected in cases:
        deltas, stopped = stream(tokenizer, ids, chunk, stop)
        assert "".join(deltas) == expected and stopped == (expected != text), stop


def steps_ran_rows_together(server, rows: int) -> bool:
    """Whether some step ran `rows` rows (the engine's step-size histogram)."""
    buckets = {
        s.labels["le"]: s.value for s in server.metrics.step_rows.collect()[0].samples if s.name.endswith("bucket")
    }
    return buckets[f"{rows - 1}.0"] < buckets[f"{rows}.0"]


def test_sampled_requests_with_their_own_seeds_share_a_batch_and_sample_as_alone(tiny, serve_at_once):
    """Requests that differ only in seed (or not even that) are one batch; each row samples with its
    request's seed, as `generate --seed` does for that prompt alone, and streams its text."""
    server = Server(tiny, "tiny", "jacobi", {"block_size": 3}, max_batch_size=8)
    asks = [("def add(a, b):", 1), ("Tom has 3 apples", 2), ("def add(a, b):", 3), ("def add(a, b):", 1)]
    bodies = [CompletionRequest(model="tiny", prompt=p, temperature=1.0, top_p=0.9, seed=seed) for p, seed in asks]
    texts = serve_at_once(server, bodies, 14)
    assert steps_ran_rows_together(server, 4)
    for (prompt, seed), text in zip(asks, texts, strict=True):
        decoder = build_decoder("jacobi", block_size=3, temperature=1.0, top_p=0.9, seed=seed)
        assert text == decoder.generate(tiny, [tiny.encode_prompt(prompt, chat_template=False)], 14)[0].text
    assert texts[0] == texts[3] != texts[2]


@pytest.mark.parametrize("decoder", ["jacobi", "setdlm"])
def test_requests_with_different_temperatures_share_a_batch_and_sample_as_alone(tiny, decoder, serve_at_once):
    """Temperature and top-p are each row's own (greedy rows included): one batch, each as alone."""
    server = Server(tiny, "tiny", decoder, {}, max_batch_size=8)
    asks = [(0.0, 1.0), (1.0, 0.9), (0.7, 1.0), (1.5, 0.5)]
    bodies = [CompletionRequest(model="tiny", prompt="def add(a, b):", temperature=t, top_p=p, seed=5) for t, p in asks]
    texts = serve_at_once(server, bodies, 14)
    assert steps_ran_rows_together(server, 4)
    ids = tiny.encode_prompt("def add(a, b):", chat_template=False)
    for (temperature, top_p), text in zip(asks, texts, strict=True):
        alone = build_decoder(decoder, temperature=temperature, top_p=top_p, seed=5).generate(tiny, [ids], 14)
        assert text == alone[0].text
    assert len(set(texts)) > 1
