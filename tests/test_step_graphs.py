"""Fixed-shape steps (`fastforward.model.step_graphs`): the same logits, tokens and cache as eager steps.

On the CPU the fixed-shape forward runs eagerly (what a graph replays, less the capture); on a CUDA GPU
(the GPU check runs these) it is captured and replayed."""

import copy

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.decoding.decoders import lookup as lookup_module
from fastforward.decoding.decoders import registry
from fastforward.decoding.runtime import start
from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model, load_model, step_graphs, visibility
from fastforward.model.tiny import tiny_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
TOL = {"rtol": 1e-4, "atol": 1e-4}  # the two kernels (causal, masked over the capacity) round apart


@pytest.fixture(scope="module", params=DEVICES)
def pair(request, tiny):
    """(the tiny model, the same weights with fixed-shape steps), both on the device."""
    eager = Model(copy.deepcopy(tiny.hf).to(request.param), tiny.tokenizer, name="tiny")
    fixed = Model(copy.deepcopy(tiny.hf).to(request.param), tiny.tokenizer, name="tiny-graphs")
    fixed.use_step_graphs(capture=request.param == "cuda")
    return eager, fixed


def _step(model: Model, cache, tokens: list[int], rule: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of `tokens` after the cache's entries (causal, or `rule` [T, T] among them), all kept;
    the logits of every new token."""
    past, length = cache.get_seq_length(), len(tokens)
    device = model.device
    seen = None if rule is None else visibility.over_cache(rule, past).to(device)
    layout = Layout(
        torch.tensor([tokens], device=device),
        torch.arange(past, past + length, device=device)[None],
        seen,
        torch.arange(length, device=device),
    )
    return model.run(layout, cache)


def test_steps_have_the_eager_steps_logits_and_cache(pair):
    """One token, a block, a block under a non-causal rule, past the first capacity (256 slots): each
    step's logits and the cache it leaves equal eager ones."""
    eager, fixed = pair
    prompt = list(range(3, 40))
    rule = visibility.causal(4) | torch.eye(4, dtype=torch.bool).roll(1, dims=1)
    with torch.inference_mode():
        caches = [eager.new_cache(), fixed.new_cache()]
        for model, cache in zip(pair, caches, strict=True):
            _step(model, cache, prompt)  # the prefill: eager in both
        steps = [([5], None), ([7, 9, 11, 13], None), ([8, 10, 12, 14], rule)] * 3 + [(list(range(3, 99)), None)] * 3
        for tokens, seen in steps:
            expected, got = (_step(m, c, tokens, seen) for m, c in zip(pair, caches, strict=True))
            torch.testing.assert_close(got, expected, **TOL)
        assert caches[1].get_seq_length() == caches[0].get_seq_length() > step_graphs.MIN_CAPACITY
        for a, b in zip(*(c.layers for c in caches), strict=True):
            torch.testing.assert_close(b.keys, a.keys, **TOL)
            torch.testing.assert_close(b.values, a.values, **TOL)
    if fixed.device.type == "cuda":  # the repeated shapes were captured and replayed
        assert sum(step.graph is not None for step in fixed.step_graphs.steps.values()) >= 3


@pytest.mark.parametrize("name", sorted(registry.specs()))
def test_every_decoder_gives_the_eager_tokens(pair, prompts, name):
    """In a batch of padded rows and one row alone, every decoder's tokens equal its eager tokens."""
    eager, fixed = pair
    decoder = build_decoder(name)
    for batch in (prompts[:3], prompts[3:]):
        expected = [g.token_ids for g in decoder.generate(eager, batch, max_new_tokens=40)]
        assert [g.token_ids for g in decoder.generate(fixed, batch, max_new_tokens=40)] == expected


def test_varying_step_lengths_run_at_a_few_bucketed_lengths(tiny, prompts, monkeypatch):
    """`lookup`'s drafts vary in length step by step; its steps run (and would be captured) at power-of-two
    lengths, not one shape per length, and still give ar's tokens."""
    model = Model(copy.deepcopy(tiny.hf), tiny.tokenizer)
    truth = build_decoder("ar").generate(model, [prompts[0]], max_new_tokens=40)[0].token_ids

    def oracle(index, length):  # the true continuation, every third drafted token wrong
        done = len(index.text) - len(prompts[0])
        return [t if (done + i) % 3 else t + 1 for i, t in enumerate(truth[done : done + length])]

    monkeypatch.setattr(lookup_module.NgramIndex, "draft", oracle)
    model.use_step_graphs(capture=False)
    seen = []
    run = model.step_graphs.run
    model.step_graphs.run = lambda tokens, *rest: seen.append(tokens.shape[1]) or run(tokens, *rest)
    assert build_decoder("lookup").generate(model, [prompts[0]], max_new_tokens=40)[0].token_ids == truth
    lengths = {shape[1] for shape in model.step_graphs.steps}
    assert len(set(seen)) > len(lengths) and all(n & (n - 1) == 0 for n in lengths)
    assert [step_graphs.bucket(n) for n in (1, 3, 5, 64, 65, 130)] == [1, 4, 8, 64, 128, 192]


def test_caches_taking_turns_keep_their_own_entries(pair, prompts):
    """Two sessions of one batch size share the buffers of one capacity: each step of one moves the
    other's entries out first, so interleaving them changes neither."""
    eager, fixed = pair
    decoder = build_decoder("ar")
    expected = [decoder.generate(eager, [p], max_new_tokens=12)[0].token_ids for p in prompts[:2]]
    with torch.inference_mode():
        sessions = [start(fixed, [p], 12) for p in prompts[:2]]
        for session in sessions:
            decoder.begin(session, range(1))
        while not all(s.finished for s in sessions):
            for session in sessions:
                if not session.finished:
                    decoder.step(session)
    assert [s.results()[0].token_ids for s in sessions] == expected


def test_cuda_graphs_on_a_cpu_are_a_clear_error():
    with pytest.raises(FastForwardError, match="CUDA"):
        load_model("demo-sbd", cuda_graphs=True)


def test_a_new_mask_token_drops_the_graphs_of_the_old_embeddings(prompts):
    """Captured graphs read the embedding matrix they were captured with; adding a token replaces it."""
    model = tiny_model(seed=0)
    model.use_step_graphs(capture=False)
    build_decoder("ar").generate(model, [prompts[0]], max_new_tokens=4)
    before = model.step_graphs
    assert before.steps
    model.add_mask_token()
    assert model.step_graphs is not before and not model.step_graphs.steps


def test_buffer_sets_stay_within_their_byte_budget(tiny, prompts):
    """Over the budget the least recently used set goes (its cache keeps its entries): batches of two
    sizes taking turns on a budget of one set still give their eager tokens."""
    model = Model(copy.deepcopy(tiny.hf), tiny.tokenizer)
    decoder = build_decoder("jacobi")
    expected = [
        [g.token_ids for g in decoder.generate(model, batch, max_new_tokens=24)] for batch in (prompts[:1], prompts[:3])
    ]
    model.use_step_graphs(capture=False)
    decoder.generate(model, prompts[:1], max_new_tokens=4)
    model.step_graphs.budget = model.step_graphs._bytes()  # room for one set of batch 1
    for _ in range(2):
        got = [
            [g.token_ids for g in decoder.generate(model, batch, max_new_tokens=24)]
            for batch in (prompts[:1], prompts[:3])
        ]
        assert got == expected
        assert len(model.step_graphs.buffers) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_fixed_step_length_gives_a_token_the_same_logits_in_a_block_as_alone(tiny, prompts, device):
    """bfloat16, every step at 64 tokens: the logits of a 40-token block equal those of its tokens fed one
    at a time, bit for bit, so lossless decoders give ar's tokens (on a GPU a one-token step and a block
    otherwise run different GEMM kernels and round apart; on this CPU they happen to agree anyway)."""
    model = Model(copy.deepcopy(tiny.hf).to(device, torch.bfloat16), tiny.tokenizer)
    model.use_step_graphs(capture=device == "cuda", step_length=64)
    block = [(7 * i) % 250 + 3 for i in range(40)]
    with torch.inference_mode():
        runs = []
        for pieces in ([block], [[t] for t in block]):
            cache = model.new_cache()
            _step(model, cache, prompts[0])
            runs.append(torch.cat([_step(model, cache, piece) for piece in pieces], dim=1))  # one-token steps: replays
    assert torch.equal(runs[0], runs[1])
    expected = [g.token_ids for g in build_decoder("ar").generate(model, prompts, max_new_tokens=24)]
    for name in ("jacobi", "lookup"):
        assert [g.token_ids for g in build_decoder(name).generate(model, prompts, max_new_tokens=24)] == expected
