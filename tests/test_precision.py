"""Quantized linears, row-invariant attention, and lossless decoding at the precisions people use."""

import os
from unittest import mock

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.cpu import attention, native, w4a8
from fastforward.cpu import quantize as quantization
from fastforward.cpu.quantize import DENSE_ROWS, Int4Linear, Int8Linear, prefill_kernels, quantize
from fastforward.decoding.decoders import ARDecoder, registry
from fastforward.errors import FastForwardError
from fastforward.model import Layout
from fastforward.model.tiny import tiny_model

LOSSLESS = sorted(name for name, spec in registry.specs().items() if spec.lossless)
# int4 runs on the native kernel where it builds (fastforward.cpu.w4a8), and on PyTorch's when asked
PRECISIONS = [("float32", "int8"), ("float32", "int4"), ("float32", "int4/pytorch"), ("bfloat16", "none")]
INT4_KINDS = [Int4Linear] + ([w4a8.W4A8Linear] if native.available() else [])
ATTENTION_KERNELS = (["native"] if native.available() else []) + ["chunked"]


def _model(dtype: str, scheme: str, exact: bool = True, smoothed: bool = True):
    """scheme: a quantization, and after a slash the int4 kernel (FASTFORWARD_INT4_KERNEL)."""
    scheme, _, kernel = scheme.partition("/")
    model = tiny_model(seed=0, init_std=0.5, hidden_size=64)
    model.add_mask_token()
    model.hf.to(getattr(torch, dtype))
    with mock.patch.dict(os.environ, {"FASTFORWARD_INT4_KERNEL": kernel or "native"}):
        quantize(model.hf, scheme, calibration=[list(range(3, 60))] if smoothed else None)  # as `load_model` does
    if exact:
        model.hf.config._attn_implementation = attention.NAME
    return model


@pytest.mark.parametrize("kind", [Int8Linear, *INT4_KINDS])
def test_quantized_linear_is_close_and_row_invariant(kind):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    layer = kind(linear)
    x = torch.randn(16, 128)
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(16)])
        reference = linear(x)
    assert torch.equal(together, alone)  # a row's result does not depend on the other rows
    error = (together - reference).abs().max() / reference.abs().max()
    assert error < (0.02 if kind is Int8Linear else 0.15)
    assert error > 0  # quantized indeed


def test_int4_prefill_multiplies_by_the_kernels_own_weights_in_bfloat16():
    torch.manual_seed(0)
    layer = Int4Linear(torch.nn.Linear(128, 64, bias=False), dense=True)
    x = torch.randn(DENSE_ROWS + 8, 128)
    with torch.inference_mode():
        kernel = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), layer.packed, 32, layer.scales_and_zeros).float()
        identity = torch.eye(128, dtype=torch.bfloat16)
        unpacked = torch._weight_int4pack_mm_for_cpu(identity, layer.packed, 32, layer.scales_and_zeros).t()
        assert torch.equal(layer.dense, unpacked)  # the very weights the kernel multiplies by
        assert torch.equal(layer(x), kernel)  # outside a prefill: the kernel
        with prefill_kernels():
            assert torch.equal(layer(x), torch.nn.functional.linear(x.bfloat16(), layer.dense).float())
            assert torch.equal(layer(x[: DENSE_ROWS - 1]), kernel[: DENSE_ROWS - 1])  # too few rows: the kernel
        assert torch.equal(layer(x), kernel)  # the context is left


def test_lossless_decoders_equal_ar_after_a_bfloat16_prefill(monkeypatch):
    # Whatever this CPU has, int4 layers keep bfloat16 weights and a long prompt's prefill uses them.
    monkeypatch.setattr(quantization, "native_bfloat16", lambda: True)
    model = _model("float32", "int4/pytorch")
    prompt = [3 + (i * 7) % 50 for i in range(DENSE_ROWS + 9)]
    ids = torch.tensor([prompt])
    layout = Layout(tokens=ids, positions=torch.arange(len(prompt))[None], visibility=None, read=None)
    with torch.inference_mode():
        run_cache, kernel_cache = model.new_cache(), model.new_cache()
        model.run(layout, run_cache)
        model.hf(input_ids=ids, **{model.cache_argument: kernel_cache.hf}, use_cache=True)
    assert not torch.equal(run_cache.layers[0].keys, kernel_cache.layers[0].keys)  # the prefill took the other path
    ar = ARDecoder().generate(model, [prompt], max_new_tokens=30)[0]
    for name in LOSSLESS:
        assert build_decoder(name).generate(model, [prompt], max_new_tokens=30)[0].token_ids == ar.token_ids, name


def test_smoothing_keeps_int8_row_invariant_and_tames_an_outlier_channel():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    x = torch.randn(16, 128)
    x[:, 5] *= 60  # one input channel far larger than the rest, as in real models
    seen = x.abs().amax(0)
    smoothed = Int8Linear(linear, (seen**0.5 / linear.weight.abs().amax(0) ** 0.5).detach())
    plain = Int8Linear(linear)
    with torch.inference_mode():
        reference = linear(x)
        together = smoothed(x)
        assert torch.equal(together, torch.cat([smoothed(x[i : i + 1]) for i in range(16)]))
        assert (together - reference).abs().mean() < 0.5 * (plain(x) - reference).abs().mean()


def test_a_quantized_model_refuses_a_new_mask_token_and_keeps_its_vocabulary():
    model = tiny_model(seed=0)
    quantize(model.hf, "int8")
    vocabulary = len(model.tokenizer)
    with pytest.raises(FastForwardError, match="before quantizing"):
        model.add_mask_token()
    assert len(model.tokenizer) == vocabulary and model.mask_token_id is None


def test_quantize_replaces_every_linear_and_unties_the_embedding():
    model = tiny_model(seed=0)
    embedding = model.hf.get_input_embeddings().weight.clone()
    quantize(model.hf, "int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.hf.modules())
    assert torch.equal(model.hf.get_input_embeddings().weight, embedding)  # the lookup keeps float weights
    with pytest.raises(FastForwardError, match="unknown quantization"):
        quantize(model.hf, "int3")


@pytest.fixture(params=ATTENTION_KERNELS)
def exact_kernel(request, monkeypatch):
    """Run `--exact` attention on the native kernel, or on the chunked SDPA calls that serve without it."""
    monkeypatch.setattr(attention, "_native", request.param == "native")
    return request.param


@pytest.mark.parametrize(("dtype", "scheme"), PRECISIONS)
@pytest.mark.parametrize("exact", [True, False])
def test_exact_attention_makes_block_logits_equal_one_token_logits(dtype, scheme, exact, exact_kernel):
    # Without row-invariant attention the two may differ in the last bits (a 40-token prompt shows it here).
    model = _model(dtype, scheme, exact, smoothed=exact)  # unsmoothed int8 shows the flip below
    prompt, block = list(range(3, 43)), torch.tensor([[5, 17, 99, 3, 42, 7, 8, 120]])
    with torch.inference_mode():
        cache = model.new_cache()
        model.hf(input_ids=torch.tensor([prompt]), **{model.cache_argument: cache.hf}, use_cache=True)
        together = model.hf(input_ids=block, **{model.cache_argument: cache.hf}, use_cache=True).logits[0]
        cache.truncate(len(prompt))
        alone = [
            model.hf(input_ids=block[:, i : i + 1], **{model.cache_argument: cache.hf}, use_cache=True).logits[0, 0]
            for i in range(8)
        ]
    alone = torch.stack(alone)
    if exact:
        assert torch.equal(together, alone)
        return
    # Without it they agree within the dtype's rounding of the largest logit (float32 here: 3e-6 of 18).
    tolerance = {"float32": 1e-4, "bfloat16": 2e-2}[dtype] * alone.abs().max()
    assert (together - alone).abs().max() <= tolerance
    if scheme == "int8":  # int8 activations turn SDPA's last-bit differences into different roundings
        assert not torch.equal(together, alone)


@pytest.mark.parametrize(("dtype", "scheme"), PRECISIONS)
@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_decoders_equal_ar_bit_for_bit_at_low_precision(prompts, dtype, scheme, name):
    model = _model(dtype, scheme)
    decoder = build_decoder(name)
    for prompt in prompts:
        ar = ARDecoder().generate(model, [prompt], max_new_tokens=30)[0]
        assert decoder.generate(model, [prompt], max_new_tokens=30)[0].token_ids == ar.token_ids


def test_lossless_decoders_equal_ar_on_chunked_exact_attention(prompts, monkeypatch):
    # The path of CPUs without the native kernel (the test above uses the native one where it runs).
    monkeypatch.setattr(attention, "_native", False)
    model = _model("float32", "int8")
    for name in LOSSLESS:
        for prompt in prompts:
            ar = ARDecoder().generate(model, [prompt], max_new_tokens=30)[0]
            assert build_decoder(name).generate(model, [prompt], max_new_tokens=30)[0].token_ids == ar.token_ids


def test_exact_attention_shares_calls_and_fixes_each_querys_row_by_its_key_count():
    # A causal block of 17 tokens after 120 cached ones sees 121..137 keys: one call per CHUNK of key
    # counts, not one per query; each query sits at row (seen - 1) % CHUNK of a width rounded up.
    chunk = attention.CHUNK
    calls = attention._plan(None, batch=1, length=17, total=137, groups=3, dtype=torch.float32)
    assert len(calls) == len({(seen - 1) // chunk for seen in range(121, 138)}) < 17
    for call in calls:
        seen = [121 + t for t in call.queries]
        assert call.index is None and call.start == 0
        assert call.rows == [(s - 1) % chunk for s in seen]
        assert all(call.width == -(-s // chunk) * chunk for s in seen)
        assert call.visible.shape == (3 * chunk, call.width)
    assert sorted(t for call in calls for t in call.queries) == list(range(17))
    # The token at slot 12 alone after 132 cached ones: the same row and width as inside the block.
    (alone,) = attention._plan(None, batch=1, length=1, total=133, groups=3, dtype=torch.float32)
    inside = next(c for c in calls if 12 in c.queries)
    assert (alone.rows, alone.width) == ([inside.rows[inside.queries.index(12)]], inside.width)


def test_exact_attention_plan_for_shared_and_scattered_visible_keys():
    # Three queries that see the same 10 keys (masks of one block) come first and take rows of one
    # call, but never the own row of the query after them, which sees 9 keys; a query whose keys skip
    # a range has them gathered in a call of its own.
    mask = torch.zeros(1, 1, 5, 12, dtype=torch.bool)
    mask[0, 0, :3, :10] = True
    mask[0, 0, 3, :9] = True
    mask[0, 0, 4, [0, 1, 2, 11]] = True
    calls = attention._plan(mask, batch=1, length=5, total=12, groups=1, dtype=torch.float32)
    gathered, *shared = calls
    assert gathered.queries == [4] and gathered.index.tolist() == [0, 1, 2, 11] and gathered.rows == [3]
    rows = {t: call.rows[call.queries.index(t)] for call in shared for t in call.queries}
    assert rows[0] == 9 % attention.CHUNK and rows[3] == 8 % attention.CHUNK  # their own rows
    assert len(set(rows[t] for t in (0, 1, 2))) == 3  # the repeats: distinct free rows of one call
    assert sum(len(call.queries) for call in shared) == 4
