"""`fastforward serve` speaks the OpenAI API as clients use it: content parts, token-id prompts and
batches, log-probabilities and echo, ignore_eos, n, seeds, routes, field policy, API keys, and 4xx
answers to malformed or oversized requests before any work they would waste, the server serving on."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from openai import OpenAI

from fastforward.api import build_decoder
from fastforward.decoding.sampling import row_key
from fastforward.serving.app import CompletionRequest, Server

PROMPT = "def add(a, b):"


def post(served, body, route: str = "completions", **options) -> httpx.Response:
    return httpx.post(f"{served[1]}/v1/{route}", json=body, timeout=60, **options)


def generated(tiny, ids: list[int], n: int, decoder: str = "ar", **knobs) -> list[int]:
    """The token ids `generate` commits for these prompt ids alone."""
    return build_decoder(decoder, **knobs).generate(tiny, [ids], n)[0].token_ids


def plain_logprobs(tiny, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from one plain float32 forward of the whole text."""
    with torch.inference_mode():
        logits = tiny.hf(input_ids=torch.tensor([ids])).logits[0].float()
    logp = logits.log_softmax(-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 for x, y in zip(a, b, strict=True))


# ---- content, prompts, batches -------------------------------------------------------------------
def test_chat_content_as_text_parts_equals_the_string(tiny, client):
    def ask(content):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=8
        ).choices[0]

    def templated(text: str) -> str:
        """What `generate` writes for the text as the user's message, chat template applied."""
        return tiny.decode(generated(tiny, tiny.encode_prompt(text), 8))

    parts = [{"type": "text", "text": "hi"}]
    assert ask(parts).message.content == ask("hi").message.content == templated("hi")
    two = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    assert ask(two).message.content == ask("hi\nthere").message.content == templated("hi\nthere")
    assert templated("hi") != tiny.decode(generated(tiny, tiny.encode_prompt("hi", chat_template=False), 8))


def test_a_non_text_content_part_is_a_400_naming_it(served):
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    response = post(served, {"model": "tiny", "messages": [{"role": "user", "content": parts}]}, "chat/completions")
    error = response.json()["error"]
    assert response.status_code == 400 and "'image_url'" in error["message"]
    assert error["param"] == "messages[0].content[1]"


def test_token_id_prompts_and_batches(tiny, client):
    ids = tiny.encode_prompt(PROMPT, chat_template=False)
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8).choices[0].text
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8).choices[0].text == text
    other = "Tom has 3 apples"
    batches = [[PROMPT, other], [ids, tiny.encode_prompt(other, chat_template=False)]]
    for batch in batches:
        out = client.completions.create(model="tiny", prompt=batch, max_tokens=8)
        assert [c.index for c in out.choices] == [0, 1]
        want = [tiny.decode(generated(tiny, tiny.encode_prompt(p, chat_template=False), 8)) for p in (PROMPT, other)]
        assert [c.text for c in out.choices] == want
        assert out.usage.prompt_tokens == len(ids) + len(tiny.encode_prompt(other, chat_template=False))


def test_token_ids_outside_the_vocabulary_are_a_400(served, tiny):
    response = post(served, {"model": "tiny", "prompt": [1, tiny.vocab_size]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


# ---- log-probabilities ---------------------------------------------------------------------------
@pytest.mark.parametrize("decoder, knobs", [("ar", {}), ("jacobi", {"block_size": 4})])
def test_completion_logprobs_are_a_plain_forward_of_the_committed_tokens(tiny, client, decoder, knobs):
    ids = tiny.encode_prompt(PROMPT, chat_template=False)
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, logprobs=3, extra_body={"decoder": decoder, **knobs}
    ).choices[0]
    completion = generated(tiny, ids, 12, decoder, **knobs)
    assert out.text == tiny.decode(completion)
    assert close(out.logprobs.token_logprobs, plain_logprobs(tiny, ids + completion)[len(ids) - 1 :])
    assert len(out.logprobs.tokens) == len(completion) == len(out.logprobs.text_offset)
    assert out.logprobs.text_offset == sorted(out.logprobs.text_offset) and out.logprobs.text_offset[0] == 0
    for token, chosen, top in zip(
        out.logprobs.tokens, out.logprobs.token_logprobs, out.logprobs.top_logprobs, strict=True
    ):
        assert token in top and len(top) <= 4 and max(top.values()) >= chosen - 1e-6  # the chosen token with the top 3


def test_chat_logprobs_are_a_plain_forward_of_the_committed_tokens(tiny, client):
    ids = tiny.encode_prompt("hi")
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
        extra_body={"decoder": "jacobi", "block_size": 3},
    ).choices[0]
    completion = generated(tiny, ids, 10, "jacobi", block_size=3)
    got = [t.logprob for t in out.logprobs.content]
    assert close(got, plain_logprobs(tiny, ids + completion)[len(ids) - 1 :])
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in out.logprobs.content)


def test_logprobs_after_a_stop_string_cover_the_tokens_of_the_returned_text(tiny, client):
    ids = tiny.encode_prompt(PROMPT, chat_template=False)
    completion = generated(tiny, ids, 16)
    full = tiny.decode(completion)
    stop = full[6:8]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stop=[stop], logprobs=0).choices[0]
    assert out.text == full[: full.find(stop)] and out.finish_reason == "stop"
    # the tokens that begin before the returned text ends: their text covers it, the stop string's do not
    kept = next(k for k in range(len(completion) + 1) if len(tiny.decode(completion[:k])) >= len(out.text))
    assert close(out.logprobs.token_logprobs, plain_logprobs(tiny, ids + completion[:kept])[len(ids) - 1 :])


@pytest.mark.parametrize("budget", [0, 1])
def test_echo_scores_the_prompt_as_lm_eval_asks(tiny, served, budget):
    """lm-eval's log-likelihood requests: token ids, echo, logprobs 1, max_tokens 0 or 1; the prompt's
    first token has a null log-probability, the others a plain forward's."""
    ids = tiny.encode_prompt("Tom has 3 apples", chat_template=False)
    body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": budget, "temperature": 0}
    choice = post(served, body).json()["choices"][0]
    completion = generated(tiny, ids, 1)[:budget]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert logprobs[0] is None and len(logprobs) == len(ids) + budget
    assert close(logprobs[1:], plain_logprobs(tiny, ids + completion))
    assert choice["text"] == tiny.decode(ids) + tiny.decode(completion)


def test_echo_without_logprobs_returns_the_prompt_and_the_completion(tiny, served):
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 5}
    choice = post(served, body).json()["choices"][0]
    completion = generated(tiny, tiny.encode_prompt(PROMPT, chat_template=False), 5)
    assert choice["text"] == PROMPT + tiny.decode(completion) and choice["logprobs"] is None


def test_a_long_echo_is_scored_in_pieces_over_a_cache_as_one_forward(tiny, served, monkeypatch):
    from fastforward.serving import logprobs

    monkeypatch.setattr(logprobs, "SCORE_ROWS", 4)
    ids = tiny.encode_prompt("The quick brown fox jumps over", chat_template=False)
    body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3}
    choice = post(served, body).json()["choices"][0]
    completion = generated(tiny, ids, 3)
    assert len(ids) > 12 and close(choice["logprobs"]["token_logprobs"][1:], plain_logprobs(tiny, ids + completion))
    one = post(served, {"model": "tiny", "prompt": [ids[0]], "echo": True, "logprobs": 1, "max_tokens": 0})
    assert one.json()["choices"][0]["logprobs"]["token_logprobs"] == [None]


# ---- ignore_eos, n, seeds ------------------------------------------------------------------------
@pytest.mark.parametrize("decoder", ["ar", "jacobi", "sbd-verified"])
def test_ignore_eos_decodes_through_stop_tokens(tiny, client, stop_on, decoder):
    ids = tiny.encode_prompt(PROMPT, chat_template=False)
    full = generated(tiny, ids, 12)
    with stop_on(full[3]):
        stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, extra_body={"decoder": decoder})
        through = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, extra_body={"decoder": decoder, "ignore_eos": True}
        )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 4
    assert through.choices[0].finish_reason == "length" and through.usage.completion_tokens == 12
    assert through.choices[0].text == tiny.decode(full)


def test_n_choices_each_sample_with_a_seed_of_the_request_seed(tiny, client):
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 3.0, "seed": 11}
    out = client.completions.create(**ask, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    ids = tiny.encode_prompt(PROMPT, chat_template=False)
    for i, text in enumerate(texts):
        seed = 11 if i == 0 else row_key(11, [i])
        assert text == build_decoder("ar", temperature=3.0, seed=seed).generate(tiny, [ids], 10)[0].text
    assert len(set(texts)) == 3
    assert out.usage.completion_tokens == 30 and out.usage.prompt_tokens == len(ids)
    stream = client.completions.create(**ask, n=3, stream=True)
    streamed = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_unseeded_samples_differ_and_a_server_seed_makes_their_sequence_reproducible(tiny, client, serve_at_once):
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 3.0}
    assert len({client.completions.create(**ask).choices[0].text for _ in range(3)}) == 3
    bodies = [CompletionRequest(model="tiny", prompt=PROMPT, temperature=3.0) for _ in range(3)]
    runs = [serve_at_once(Server(tiny, "tiny", "ar", {"seed": 5}, max_batch_size=4), bodies, 12) for _ in range(2)]
    assert runs[0] == runs[1] and len(set(runs[0])) == 3


# ---- routes, fields ------------------------------------------------------------------------------
def test_model_by_id_and_openai_errors_for_routes(served, client):
    assert client.models.retrieve("tiny").id == "tiny"
    for method, path, status in [
        ("GET", "/v1/models/other", 404),
        ("POST", "/v1/nothing", 404),
        ("GET", "/v1/completions", 405),
    ]:
        response = httpx.request(method, served[1] + path)
        assert response.status_code == status and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_an_unexpected_failure_is_a_500_with_an_openai_body(served, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(Server, "encode_text", broken)
    response = post(served, {"model": "tiny", "prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["message"] == "RuntimeError: boom"


@pytest.mark.parametrize(
    "extra, status, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "'tools' is not supported"),
        ({"response_format": {"type": "json_object"}}, 400, "'response_format' is not supported"),
        ({"logit_bias": {"5": 10}}, 400, "'logit_bias' is not supported"),
        ({"wat": 1}, 400, "unrecognized request field 'wat'"),
        ({"gamma": 0.3}, 400, "field 'gamma' 0.3 does not apply to the 'ar' decoder"),
        ({"decoder": "jacobi", "block_size": "4"}, 400, "'block_size' takes a int"),
        ({"tools": [], "tool_choice": "none", "user": "u", "metadata": {"a": "b"}, "store": False}, 200, ""),
        ({"parallel_tool_calls": True, "service_tier": "auto", "stream_options": {"include_usage": True}}, 200, ""),
    ],
)
def test_fields_the_server_does_not_implement_are_named_and_neutral_ones_accepted(served, extra, status, words):
    response = post(
        served, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}, "chat/completions"
    )
    assert response.status_code == status, response.text
    if status != 200:
        message = response.json()["error"]["message"]
        assert words in message and "--" not in message


# ---- limits and malformed requests ---------------------------------------------------------------
READ, PARSE, TOKENIZE = "read", "parse", "tokenize"


def malformed() -> list[tuple[str, dict, int, str, set[str]]]:
    """(what, httpx.post options, status, words in the message, the stages that ran before the refusal)."""
    good = {"model": "tiny", "prompt": PROMPT}
    nested = "[" * 100_000 + "]" * 100_000
    parsed = {READ, PARSE}
    return [
        (
            "huge max_tokens",
            {"json": good | {"max_tokens": 10**9}},
            400,
            "1000000009 tokens (9 in the prompt, 1000000000 in max_tokens)",
            {READ, PARSE, TOKENIZE},  # the prompt's tokens count
        ),
        ("20 MB prompt", {"json": good | {"prompt": "a" * 20_000_000}}, 413, "limit of 4194304", set()),
        ("long prompt", {"json": good | {"prompt": "a " * 100_000}}, 400, "characters", parsed),
        ("invalid UTF-8", {"content": b'{"model": "tiny", "prompt": "\xff\xfe"}'}, 400, "not valid UTF-8", {READ}),
        (
            "deep JSON",
            {"content": ('{"model": "tiny", "prompt": ' + nested + "}").encode()},
            400,
            "nested too deeply",
            parsed,
        ),
        (
            "NaN temperature",
            {"content": b'{"model": "tiny", "prompt": "x", "temperature": NaN}'},
            400,
            "'temperature'",
            parsed,
        ),
        ("negative budget", {"json": good | {"max_tokens": -3}}, 400, "'max_tokens'", parsed),
        ("not JSON", {"content": b"model=tiny&prompt=x"}, 400, "not valid JSON", parsed),
        ("JSON not an object", {"json": [good]}, 400, "JSON object", parsed),
        (  # a decoder setting: checked where the request's decoder is built, after its prompt
            "negative temperature",
            {"json": good | {"temperature": -1}},
            400,
            "temperature must be >= 0",
            {READ, PARSE, TOKENIZE},
        ),
    ]


@pytest.fixture
def stages(tiny, monkeypatch) -> set[str]:
    """The stages a request went through, as they run: reading its body, parsing it as JSON, tokenizing."""
    from starlette.requests import Request

    from fastforward.serving import guard

    ran: set[str] = set()
    stream, loads, encode = Request.stream, json.loads, tiny.encode_prompt
    monkeypatch.setattr(Request, "stream", lambda self: ran.add(READ) or stream(self))
    monkeypatch.setattr(guard, "json", SimpleNamespace(loads=lambda text: ran.add(PARSE) or loads(text)))
    monkeypatch.setattr(tiny, "encode_prompt", lambda *args, **kwargs: ran.add(TOKENIZE) or encode(*args, **kwargs))
    return ran


def test_malformed_and_oversized_requests_are_refused_before_the_work_and_the_server_serves_on(
    tiny, served, client, stages
):
    """Each refusal comes from the first stage that can tell: an oversized body is refused by its
    declared size before it is read, a prompt too long for the context before it is tokenized."""
    for what, options, status, words, ran in malformed():
        stages.clear()
        response = httpx.post(served[1] + "/v1/completions", timeout=60, **options)
        assert response.status_code == status, (what, response.text[:300])
        assert words in response.json()["error"]["message"], (what, response.json())
        assert stages == ran, what
    ids = tiny.encode_prompt(PROMPT, chat_template=False)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).choices[0].text == tiny.decode(
        generated(tiny, ids, 4)
    )


def test_a_budget_past_the_context_names_both_numbers_and_no_budget_is_cut_to_fit(tiny, http_server):
    server = Server(tiny, "tiny", "ar", {}, max_batch_size=2, max_tokens=400)
    ids = [5] * 300
    with http_server(server) as url:
        over = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 300})
        cut = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "ignore_eos": True}, timeout=60)
    assert (
        over.status_code == 400
        and "512" in over.json()["error"]["message"]
        and "600" in over.json()["error"]["message"]
    )
    assert cut.status_code == 200 and cut.json()["usage"]["completion_tokens"] == 512 - 300


# ---- API key, port ---------------------------------------------------------------------------------
def test_an_api_key_is_required_on_every_route_but_health(tiny, http_server):
    server = Server(tiny, "tiny", "ar", {}, max_batch_size=2, api_key="s3cret")
    with http_server(server) as url:
        for path in ("/v1/models", "/v1/completions", "/metrics", "/v1/nothing"):
            response = httpx.post(url + path, json={"model": "tiny", "prompt": "x"})
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        wrong = OpenAI(base_url=url + "/v1", api_key="other", max_retries=0)
        with pytest.raises(Exception, match="401"):
            wrong.models.list()
        right = OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert right.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text is not None
        assert httpx.get(url + "/health").status_code == 200


def test_a_port_in_use_fails_before_loading(capsys, monkeypatch):
    import socket

    from fastforward.cli import main
    from fastforward.serving import warm_up

    loads = []
    monkeypatch.setattr(warm_up, "load_model", lambda *args, **kwargs: loads.append(args))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--model", "no/such/model", "--port", str(port), "--no-compile"])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}: it is in use" in err
    assert len(err.strip().splitlines()) == 1 and loads == []


def test_a_decoder_that_needs_a_mask_token_is_a_400_on_a_model_without_one(http_server):
    from fastforward.model.tiny import tiny_model

    server = Server(tiny_model(seed=0), "plain", "ar", {}, max_batch_size=2)
    with http_server(server) as url:
        body = {"model": "plain", "prompt": "x", "max_tokens": 2, "decoder": "sbd"}
        response = httpx.post(url + "/v1/completions", json=body)
        assert response.status_code == 400 and "mask token" in response.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json=body | {"decoder": "ar"}).status_code == 200


def test_the_api_key_comes_from_the_flag_or_the_environment_and_seed_is_the_servers(monkeypatch):
    from fastforward.cli import build_parser
    from fastforward.cli.serve import serve_knobs

    monkeypatch.setenv("FASTFORWARD_API_KEY", "from-env")
    args = build_parser("serve").parse_args(["serve", "--seed", "3", "--temperature", "0.5"])
    assert args.api_key == "from-env" and args.max_request_bytes == 4 * 2**20
    assert build_parser("serve").parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    assert serve_knobs(args) == {"temperature": 0.5} and args.seed == 3  # not a decoder option: the draws' base
