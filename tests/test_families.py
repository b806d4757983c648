"""Every kind of transformers causal LM the README names, as tiny random models saved and loaded the way
a user loads one (`load_model(folder)`): sliding-window and hybrid layers (Mistral, Qwen2 with a window,
Gemma 2 and 3, Cohere2, Olmo3), logit soft-capping (Gemma 2), learned absolute positions (GPT-2),
parallel attention and MLP blocks (GPT-NeoX), mixture-of-experts routing (Qwen3-MoE), tied and untied
output layers. Prompts are longer than the window (6 positions), so every sliding layer drops keys.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import transformers as T

import fastforward as ff
from fastforward.decoding.decoders import registry
from fastforward.errors import FastForwardError
from fastforward.model import Layout, core, head, load_model
from fastforward.model.tiny import DEFAULT_CORPUS, fit_tokenizer
from fastforward.training.data import Batch
from fastforward.training.objectives import SBD, JacobiForcing, MultiTF, SetDLM
from fastforward.training.objectives.base import causal_layout
from fastforward.training.trajectories.dataset import TrajectoryData
from fastforward.training.trajectories.writer import collect

WINDOW = 6
WINDOWED = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
FAMILIES = {  # name: (config class, model class, options beyond the shared tiny shape)
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "mistral-window": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": WINDOW}),
    "qwen2-window": (
        T.Qwen2Config,
        T.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),
    "qwen3-moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {**WINDOWED, "head_dim": 16}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, {**WINDOWED, "head_dim": 16}),
    "cohere2": (T.Cohere2Config, T.Cohere2ForCausalLM, WINDOWED),
    "olmo3": (T.Olmo3Config, T.Olmo3ForCausalLM, WINDOWED),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"tie_word_embeddings": False}),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, {}),
    "gpt-neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {"use_parallel_residual": True}),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {}),
}
TEXTS = ["def add(a, b):\n    return a + b\nThe quick", "Tom has 3 apples and buys 5 more.", "0123456789 + -"]
NEW_TOKENS = 10
LOSSLESS = [name for name, spec in registry.specs().items() if spec.lossless and not spec.needs_mask]


@pytest.fixture(scope="module")
def tokenizer():
    return fit_tokenizer(DEFAULT_CORPUS, 300)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tokenizer, tmp_path_factory):
    """(name, folder, model class): a tiny random model of the family, saved with save_pretrained."""
    config_class, model_class, options = FAMILIES[request.param]
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if config_class is T.GPT2Config:
        shape = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "bos_token_id": tokenizer.eos_token_id}
    else:
        shape = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "bos_token_id": None,
        }
    config = config_class(vocab_size=len(tokenizer), initializer_range=0.5, **shape, **special, **options)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param)
    model_class(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return request.param, folder, model_class


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in TEXTS]


def test_prompts_are_longer_than_the_window(prompts):
    assert min(len(p) for p in prompts) > WINDOW


def test_ar_equals_transformers_greedy_generate(family, prompts):
    name, folder, model_class = family
    model = load_model(str(folder))
    reference = model_class.from_pretrained(folder).eval()  # transformers' own attention and cache
    for prompt in prompts:
        ids = torch.tensor([prompt])
        budget = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), **budget)
        ours = ff.build_decoder("ar").generate(model, [prompt], NEW_TOKENS)[0].token_ids
        assert ours == expected[0, len(prompt) :].tolist()


def test_cached_logits_equal_uncached(family, prompts):
    model = load_model(str(family[1]))
    prompt = prompts[0]
    n, k = len(prompt), 5
    ids, positions = torch.tensor([prompt]), torch.arange(n)[None]
    with torch.inference_mode():
        whole = model.run(Layout(ids, positions, None, read=torch.arange(n)), None)
        cache = model.new_cache()
        model.run(Layout(ids[:, : n - k], positions[:, : n - k], None), cache)
        block = model.run(Layout(ids[:, n - k :], positions[:, n - k :], None, read=torch.arange(k)), cache)
    torch.testing.assert_close(block[0], whole[0, n - k :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_lossless_decoders_equal_ar_alone_and_in_a_batch(family, prompts, scheme):
    model = load_model(str(family[1]), quantize=scheme, exact=scheme != "none")
    expected = [ff.build_decoder("ar").generate(model, [p], NEW_TOKENS)[0].token_ids for p in prompts]
    for name in LOSSLESS:
        knobs = {"block_size": 4} if registry.spec(name).knob("block_size") else {}
        decoder = ff.build_decoder(name, **knobs)
        alone = [decoder.generate(model, [p], NEW_TOKENS)[0].token_ids for p in prompts]
        together = [g.token_ids for g in decoder.generate(model, prompts, NEW_TOKENS)]
        assert alone == expected and together == expected, name


def test_fixed_shape_steps_give_the_eager_tokens(family, prompts):
    """The steps CUDA graphs replay (`step_graphs`), run eagerly: every family without sliding windows
    gives its eager tokens, alone and in a batch; a windowed one is refused with a clear error."""
    model = load_model(str(family[1]))
    if model.window is not None:
        with pytest.raises(FastForwardError, match="sliding windows"):
            model.use_step_graphs(capture=False)
        return
    decoders = [ff.build_decoder(name) for name in ("ar", "jacobi")]
    expected = [[g.token_ids for g in d.generate(model, prompts, NEW_TOKENS)] for d in decoders]
    model.use_step_graphs(capture=False)
    assert [[g.token_ids for g in d.generate(model, prompts, NEW_TOKENS)] for d in decoders] == expected


def test_sbd_verified_equals_ar_after_a_mask_token(family, prompts):
    model = load_model(str(family[1]))
    model.add_mask_token()
    expected = [g.token_ids for g in ff.build_decoder("ar").generate(model, prompts, NEW_TOKENS)]
    got = [g.token_ids for g in ff.build_decoder("sbd-verified", block_size=4).generate(model, prompts, NEW_TOKENS)]
    assert got == expected


@pytest.mark.parametrize("masked_keep", [True, False], ids=["row-slots", "shared-columns"])
def test_losses_read_the_models_own_logits_at_their_slots(family, prompts, masked_keep, monkeypatch):
    """`Model.logits_at`, which every training loss reads, gives transformers' logits at the slots asked for,
    the family's output head included (Gemma 2's final soft-capping, Cohere 2's logit scale), on padded rows:
    with each row's own slots kept (transformers >= 5.2x) and with the columns any row needs (older ones)."""
    monkeypatch.setattr(core, "MASKED_KEEP", masked_keep)
    model = load_model(str(family[1]))
    width = max(map(len, prompts))
    tokens = torch.tensor([p + [model.pad_token_id] * (width - len(p)) for p in prompts])
    valid = torch.arange(width) < torch.tensor([[len(p)] for p in prompts])
    layout = causal_layout(Batch(tokens, valid, valid))
    first = (torch.tensor([0, 2, 1, 0]), torch.tensor([3, 0, 5, 1]))
    second = (torch.tensor([1, 0]), torch.tensor([2, 3]))  # (0, 3) in both
    full = model.run(replace(layout, read=torch.arange(width)), None)
    got = model.logits_at(layout, first, second)
    for logits, (rows, slots) in zip(got, (first, second), strict=True):
        torch.testing.assert_close(logits, full[rows, slots], rtol=1e-5, atol=1e-5)
    if family[0] in ("gemma2", "cohere2"):  # what the output layer alone would give differs
        raw = model.hf.get_output_embeddings()(model.hidden_states(layout))
        assert not torch.allclose(raw[first], full[first], atol=1e-2)


def test_losses_projected_a_chunk_at_a_time_equal_whole_logits(family, prompts, monkeypatch):
    """Where `outputs_at` projects hidden states itself (a plain output layer: the family's logits are those of
    its layer), the cross entropy and every weight's gradient are those of whole logits (float64, where float32
    rounding would blur a difference); Gemma 2 and Cohere 2, whose logits change after the layer, are handed
    their own logits instead."""
    monkeypatch.setattr(head, "CHUNK_FLOATS", 3 * 300)  # several chunks
    model = load_model(str(family[1]))
    rows = torch.tensor([(p * 4)[:12] for p in prompts])
    ones = torch.ones_like(rows, dtype=torch.bool)
    layout = causal_layout(Batch(rows, ones, ones))
    slots = (torch.tensor([0, 2, 1, 1, 0]), torch.tensor([3, 0, 5, 11, 7]))
    targets = torch.tensor([7, 30, 2, 299, 41])
    (got,) = model.outputs_at(layout, slots)
    if family[0] in ("gemma2", "cohere2"):
        assert got.logits is not None
        return
    (own,) = model.logits_at(layout, slots)
    layer = model.hf.get_output_embeddings()
    with torch.no_grad():
        torch.testing.assert_close(layer(model.hidden_states(layout)[slots]), own, rtol=1e-5, atol=1e-5)
    precise = family[0] != "qwen3-moe"  # its experts' grouped products take no float64
    tolerance = {"rtol": 1e-9, "atol": 1e-12} if precise else {"rtol": 1e-4, "atol": 1e-5}
    if precise:
        model.hf.double()
    (got,) = model.outputs_at(layout, slots)
    loss = head.cross_entropy(got, targets)
    expected = F.cross_entropy(layer(model.hidden_states(layout)[slots]), targets, reduction="sum")
    torch.testing.assert_close(loss, expected.to(loss.dtype), **tolerance)
    weights = [p for p in model.hf.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(loss, weights), torch.autograd.grad(expected, weights), strict=True):
        torch.testing.assert_close(a, b, rtol=tolerance["rtol"], atol=tolerance["atol"] * float(b.abs().max()))


def test_every_objective_takes_a_training_step(family, prompts, tmp_path):
    model = load_model(str(family[1]))
    rows = torch.tensor([(p * 4)[:24] for p in prompts])
    ones = torch.ones_like(rows, dtype=torch.bool)
    batch = Batch(rows, ones, ones)
    path = tmp_path / "trajectories.jsonl"
    collect(model, prompts, path, block_size=4, max_new_tokens=8, progress=False)
    objectives = [
        (SBD(min_block=2, max_block=4), batch),
        (MultiTF(min_block=2, max_block=4), batch),
        (SetDLM(), batch),
        (JacobiForcing(noise_window=4), TrajectoryData.from_file(path, 64).batch(0, 2, 0)),
    ]
    for objective, data in objectives:
        name = type(objective).__name__
        objective.setup(model)
        parameters = dict(model.hf.named_parameters())
        before = {k: p.detach().clone() for k, p in parameters.items()}
        optimizer = torch.optim.Adam(parameters.values(), lr=1e-3)  # its step does not shrink with tiny gradients
        loss, _ = objective.loss(model, data, torch.Generator().manual_seed(0))
        loss.backward()
        reached = {k for k, p in parameters.items() if p.grad is not None and p.grad.abs().sum() > 0}
        optimizer.step()
        optimizer.zero_grad()
        changed = {k for k, p in parameters.items() if not torch.equal(p, before[k])}
        assert torch.isfinite(loss), name
        assert reached == set(parameters), (name, set(parameters) - reached)
        assert changed == set(parameters), (name, set(parameters) - changed)


@pytest.mark.parametrize("kind", ["chunked_attention", "linear_attention"])
def test_layer_kinds_it_cannot_run_are_refused_by_name(tokenizer, tmp_path, kind):
    config = T.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    config.layer_types = [kind, "full_attention"]
    T.LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(FastForwardError, match=f"layers of kind {kind}"):
        load_model(str(tmp_path))
