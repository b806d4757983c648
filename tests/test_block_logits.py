"""A token's logits do not depend on what shares its forward, at the size of a real block.

The property `benchmarks/exactness.py` probed on SmolLM2-135M (removed after commit 5ed3e50; its
figures are in docs/results.md#precision-and-exactness): a 16-token block fed after a prompt gives
each token the very logits it gets fed alone, one token per forward, with `--exact` at every
precision whose lossless decoding is exact (int8, int4 on either kernel, bfloat16). Here on a tiny
model loaded as users load one (`load_model(..., exact=True)`), with a prompt of 37 tokens so that
the block's queries straddle several 8-row calls of the chunked attention and the native int4
kernel's 8-row tiles, through the causal path and through a dense mask (the path of decoders whose
blocks are not plain causal).
"""

import os
from unittest import mock

import pytest
import torch

from fastforward.cpu import attention, native
from fastforward.model import Layout, load_model, visibility
from fastforward.model.tiny import tiny_model

PROMPT = list(range(3, 40))  # 37 tokens: the block's key counts run 38..53, across three multiples of 8
BLOCK = [5, 17, 99, 3, 42, 7, 8, 120, 64, 11, 250, 31, 2, 77, 150, 9]
SETTINGS = {  # dtype, quantization, int4 kernel (FASTFORWARD_INT4_KERNEL)
    "int8": ("float32", "int8", "native"),
    "int4": ("float32", "int4", "native"),
    "int4/pytorch": ("float32", "int4", "pytorch"),
    "bfloat16": ("bfloat16", "none", "native"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random llama with peaked predictions, saved as a checkpoint directory."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model(seed=0, init_std=0.5, hidden_size=64).save(path)
    return str(path)


def feed(model, cache, tokens: list[int], dense_mask: bool) -> torch.Tensor:
    """Logits [len(tokens), V] of `tokens` fed in one forward after what `cache` holds."""
    past, n = cache.get_seq_length(), len(tokens)
    rule = visibility.over_cache(visibility.causal(n), past) if dense_mask else None
    layout = Layout(torch.tensor([tokens]), torch.arange(past, past + n)[None], rule, torch.arange(n))
    return model.run(layout, cache)[0]


@pytest.mark.parametrize("kernel", ["native", "chunked"])
@pytest.mark.parametrize("dense_mask", [False, True], ids=["causal", "dense-mask"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_block_logits_equal_one_token_logits(saved, monkeypatch, setting, dense_mask, kernel):
    if kernel == "native" and not native.available():
        pytest.skip("the native exact-attention kernel does not build here")
    monkeypatch.setattr(attention, "_native", kernel == "native")
    dtype, scheme, int4_kernel = SETTINGS[setting]
    with mock.patch.dict(os.environ, {"FASTFORWARD_INT4_KERNEL": int4_kernel}):
        model = load_model(saved, dtype=dtype, quantize=scheme, exact=True)
    block_cache, token_cache = model.new_cache(), model.new_cache()
    with torch.inference_mode():
        for cache in (block_cache, token_cache):
            feed(model, cache, PROMPT, dense_mask=False)  # the same prefill for both
        together = feed(model, block_cache, BLOCK, dense_mask)
        alone = torch.cat([feed(model, token_cache, [token], dense_mask=False) for token in BLOCK])
    assert torch.equal(together, alone)
    for a, b in zip(block_cache.layers, token_cache.layers, strict=True):  # the cached entries too
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
