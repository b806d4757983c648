"""Compiled decoding steps (`load_model(..., compile=True)`): lossless decoders stay exact."""

import pytest
import torch

from fastforward import attention
from fastforward.api import build_decoder
from fastforward.compiled import warm_up
from fastforward.decoders import ARDecoder
from fastforward.errors import FastForwardError
from fastforward.quantize import quantize
from fastforward.tiny import tiny_model


@pytest.fixture(scope="module")
def compiled():
    """A tiny int4 model with row-invariant attention and compiled steps (compiled once per module:
    each graph takes seconds to build)."""
    torch._dynamo.reset()
    model = tiny_model(seed=0, init_std=0.5, hidden_size=64)
    model.add_mask_token()
    quantize(model.hf, "int4")
    model.hf.config._attn_implementation = attention.NAME
    model.compile_steps()
    model.graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return model


def compiled_inputs(model, monkeypatch) -> list[torch.Tensor]:
    """The input ids of every forward that goes through the model's compiled forward from now on."""
    seen, forward = [], model.compiled_forward

    def spy(**inputs):
        seen.append(inputs["input_ids"])
        return forward(**inputs)

    monkeypatch.setattr(model, "compiled_forward", spy)
    return seen


def test_steps_run_compiled_and_the_prefill_eager(compiled, prompts, monkeypatch):
    seen = compiled_inputs(compiled, monkeypatch)
    ARDecoder().generate(compiled, [prompts[0]], max_new_tokens=4)
    assert [tuple(ids.shape) for ids in seen] == [(1, 1)] * 3  # the three steps after the prefill's token


@pytest.mark.parametrize("name", ["lookup", "jacobi", "jacobi-mr"])
def test_lossless_decoders_equal_compiled_ar(compiled, prompts, name):
    decoder = build_decoder(name)
    for prompt in prompts:
        ar = ARDecoder().generate(compiled, [prompt], max_new_tokens=30)[0]
        assert decoder.generate(compiled, [prompt], max_new_tokens=30)[0].token_ids == ar.token_ids
    # graphs per kind of forward, not per length: {one token, a block} x {a one-entry cache (the
    # one-token prompt), longer} + a masked block (jacobi-mr)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - compiled.graphs_before <= 5


def test_a_growing_cache_compiles_no_new_graph(cached_step):
    """150 one-token steps: the cache's buffers double twice (past 64 and 128 entries) and fill up to
    their spare entry; one graph serves them all. Head size 64, as the first capacity: sizes that
    coincide must not be traced as one symbol (dynamo's duck sizing)."""
    model = tiny_model(seed=0, init_std=0.5, hidden_size=256)
    quantize(model.hf, "int4")
    model.hf.config._attn_implementation = attention.NAME
    model.compile_steps()
    cache, graphs = model.new_cache(), torch._dynamo.utils.counters["stats"]["unique_graphs"]

    with torch.inference_mode():
        logits = cached_step(model, cache, [1, 2, 3])
        for _ in range(150):
            logits = cached_step(model, cache, [int(logits[0, -1].argmax())])
    assert cache.get_seq_length() == 153
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


def test_warm_up_compiles_one_row_and_a_batch(compiled, monkeypatch):
    seen = compiled_inputs(compiled, monkeypatch)
    assert warm_up(compiled, ARDecoder()) > 0
    assert {ids.shape[0] for ids in seen} == {1, 2}


def test_compile_without_a_cxx_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(FastForwardError, match="needs a C\\+\\+ compiler"):
        tiny_model(seed=0).compile_steps()
