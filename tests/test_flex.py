"""FlexAttention (`fastforward.model.flex`) gives the dense SDPA path's outputs for every visibility rule,
with and without a cache, on every device this machine has (the GPU check runs these on CUDA)."""

import copy

import pytest
import torch

from fastforward.decoding.decoders import ARDecoder, JacobiDecoder, VerifiedSBDDecoder
from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model, flex, visibility

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module", params=DEVICES)
def pair(request, tiny):
    """(the tiny model on SDPA, the same weights on FlexAttention), both on the device."""
    dense = Model(copy.deepcopy(tiny.hf).to(request.param), tiny.tokenizer, name="tiny-sdpa")
    hf = copy.deepcopy(tiny.hf).to(request.param)
    hf.config._attn_implementation = flex.NAME
    return dense, Model(hf, tiny.tokenizer, name="tiny-flex")


def _tokens(model: Model, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.vocab_size, (batch, length), generator=generator).to(model.device)


def _training_rules(length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name → (visibility [B, T, T], positions [B, T]) of each training layout, for a batch of 2."""
    positions = torch.arange(length).repeat(2)[None].expand(2, -1)
    ranks = torch.stack([torch.randperm(length, generator=torch.Generator().manual_seed(i)) for i in range(2)])
    jf_prompt, jf_blocks = 4, [3, 3]
    jf_length = jf_prompt + 2 * sum(jf_blocks)
    jf_positions = torch.cat([torch.arange(jf_prompt)] + [torch.arange(jf_prompt, jf_prompt + 3)] * 4)
    return {
        "sbd": (visibility.sbd_train(length, 4)[None].expand(2, -1, -1), positions),
        "multitf": (visibility.multitf_train(length, 4, torch.tensor([[0, 0, 1], [0, 1, 2]])), positions),
        "setdlm": (visibility.reveal_order(ranks, ranks), torch.cat([torch.arange(length)] * 2)[None].expand(2, -1)),
        "jacobi_forcing": (
            visibility.jacobi_forcing_train(jf_prompt, jf_blocks)[None].expand(2, jf_length, jf_length),
            jf_positions[None].expand(2, -1),
        ),
    }


@pytest.mark.parametrize("rule", ["sbd", "multitf", "setdlm", "jacobi_forcing"])
def test_training_layouts_match_dense(pair, rule):
    dense, flexed = pair
    seen, positions = _training_rules(12)[rule]
    tokens = _tokens(dense, 2, seen.shape[-1])
    layout = Layout(tokens, positions.to(dense.device), seen.to(dense.device))
    with torch.inference_mode():
        torch.testing.assert_close(flexed.hidden_states(layout), dense.hidden_states(layout), **TOL)


def _decoding_rules() -> dict[str, torch.Tensor]:
    return {
        "causal": visibility.causal(5),
        "sbd": visibility.sbd_decode(2, 4),
        "multi_block": visibility.block_causal_decode(2, (3, 2), padding=1),
        "jacobi_candidates": visibility.jacobi_candidates(3, (2, 2)),
    }


@pytest.mark.parametrize("rule", ["causal", "sbd", "multi_block", "jacobi_candidates", "plain"])
def test_decoding_layouts_against_a_padded_cache_match_dense(pair, rule):
    """A batch of two rows, the second left-padded, prefilled, then one decoding layout on top."""
    dense, flexed = pair
    device, past = dense.device, 7
    key_valid = torch.ones(2, past, dtype=torch.bool, device=device)
    if rule != "plain":  # a plain causal layout (visibility None) has unpadded rows
        key_valid[1, :2] = False
    prompt = _tokens(dense, 2, past, seed=1)
    prompt_seen = visibility.over_cache(visibility.causal(past, device), 0, key_valid)
    prompt_positions = (key_valid.cumsum(1) - 1).clamp(min=0)
    new = 5 if rule == "plain" else _decoding_rules()[rule].shape[0]
    step = _tokens(dense, 2, new, seed=2)
    step_positions = prompt_positions[:, -1:] + 1 + torch.arange(new, device=device)
    if rule == "plain":
        step_seen = None
    else:
        step_valid = torch.cat([key_valid, torch.ones(2, new, dtype=torch.bool, device=device)], dim=1)
        step_seen = visibility.over_cache(_decoding_rules()[rule].to(device), past, step_valid)
    outputs = []
    for model in (dense, flexed):
        cache = model.new_cache()
        with torch.inference_mode():
            first = model.run(Layout(prompt, prompt_positions, prompt_seen, torch.arange(past)), cache)
            later = model.run(Layout(step, step_positions, step_seen, torch.arange(new)), cache)
        outputs.append((first, later, cache.layers[0].keys))
    for got, want in zip(outputs[1], outputs[0], strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("decoder", [JacobiDecoder(4), VerifiedSBDDecoder(4)], ids=["jacobi", "sbd-verified"])
def test_lossless_decoders_on_flex_give_ar_tokens(pair, prompts, decoder):
    dense, flexed = pair
    ar = [g.token_ids for g in ARDecoder().generate(dense, prompts, max_new_tokens=12)]
    assert [g.token_ids for g in decoder.generate(flexed, prompts, max_new_tokens=12)] == ar


def test_attention_choices(monkeypatch):
    assert flex.implementation("sdpa") == "sdpa"
    assert flex.implementation("flex") == flex.NAME
    with pytest.raises(FastForwardError, match="unknown attention 'fast'"):
        flex.implementation("fast")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [flex.for_training("auto", o) for o in ("ntp", "sbd", "setdlm")] == ["sdpa", "flex", "flex"]
    assert flex.for_training("sdpa", "sbd") == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flex.for_training("auto", "sbd") == "sdpa"


def test_auto_attention_follows_the_device_training_runs_on(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flex.for_training("auto", "sbd") == "flex" and flex.for_training("auto", "ntp") == "sdpa"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # accelerate then trains on the CPU, beside the GPU
    assert flex.for_training("auto", "sbd") == "sdpa"


@pytest.mark.skipif(torch.cuda.is_available(), reason="beside a CUDA GPU, training runs on it")
def test_flex_training_on_the_cpu_is_refused(tmp_path):
    """FlexAttention has no CPU backward: the trainer says so before the first step."""
    from fastforward.model.tiny import tiny_model
    from fastforward.training.data import Example, PackedData
    from fastforward.training.objectives import make_objective
    from fastforward.training.trainer import TrainConfig, train

    model = tiny_model()
    model.hf.config._attn_implementation = flex.NAME
    data = PackedData([Example(list(range(3, 40)), [True] * 37)], 16, model.pad_token_id)
    with pytest.raises(FastForwardError, match="FlexAttention trains only on CUDA"):
        train(model, make_objective("sbd"), data, TrainConfig(steps=1, seq_len=16, batch_size=1), tmp_path / "run")


def test_sliding_window_models_are_refused_by_name(tiny):
    """FlexAttention has no sliding-window masks yet: such a model on flex is refused with its own
    error, which `train --attention auto` answers by taking SDPA."""
    hf = copy.deepcopy(tiny.hf)
    hf.config.sliding_window = 4
    hf.config._attn_implementation = flex.NAME
    with pytest.raises(flex.FlexUnsupported, match="--attention sdpa"):
        Model(hf, tiny.tokenizer)
    hf.config._attn_implementation = "sdpa"
    assert Model(hf, tiny.tokenizer).window is not None
