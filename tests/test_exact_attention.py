"""The native row-invariant attention kernel (fastforward::exact_attention): close to SDPA, each
query's bits fixed by its own visible keys, and the choice between it and the chunked SDPA calls."""

import pytest
import torch

from fastforward.cpu import attention, native
from fastforward.errors import FastForwardError

needs_native = pytest.mark.skipif(not native.available(), reason="needs x86 AVX2 or AVX-512 and a C++ compiler")
HEADS, KV_HEADS, DIM, SCALE = 6, 2, 32, 0.2


def _inputs(dtype: torch.dtype, batch: int = 2, length: int = 5, total: int = 37):
    torch.manual_seed(0)
    query = torch.randn(batch, length, HEADS, DIM).to(dtype).transpose(1, 2)  # strided, as a llama's projection gives
    key, value = (torch.randn(batch, KV_HEADS, total, DIM).to(dtype) for _ in range(2))
    return query, key, value


def _sdpa(query, key, value, mask):
    groups = HEADS // KV_HEADS
    key, value = (t.float().repeat_interleave(groups, 1) for t in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query.float(), key, value, attn_mask=mask, scale=SCALE)
    return out.transpose(1, 2)


def _scattered_mask(batch: int, length: int, total: int) -> torch.Tensor:
    """Causal rows, one of which skips a range of keys (a candidate beside others, as in jacobi-mr)."""
    mask = torch.ones(length, total, dtype=torch.bool).tril(total - length)
    mask[2, 10:20] = False
    return mask.expand(batch, 1, length, total)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_close_to_sdpa(dtype):
    query, key, value = _inputs(dtype)
    causal = torch.ones(5, 37, dtype=torch.bool).tril(32)
    for mask, reference_mask in ((None, causal), (_scattered_mask(2, 5, 37), _scattered_mask(2, 5, 37))):
        out = torch.ops.fastforward.exact_attention(query, key, value, mask, SCALE)
        assert out.dtype == torch.float32 and out.shape == (2, 5, HEADS, DIM)
        torch.testing.assert_close(out, _sdpa(query, key, value, reference_mask), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_bits_depend_only_on_its_visible_keys(dtype):
    query, key, value = _inputs(dtype)
    mask = _scattered_mask(2, 5, 37)
    together = torch.ops.fastforward.exact_attention(query, key, value, mask, SCALE)
    for t in range(5):
        visible = mask[0, 0, t].nonzero()[:, 0]
        alone = torch.ops.fastforward.exact_attention(
            query[:, :, t : t + 1].contiguous(), key[:, :, visible], value[:, :, visible], None, SCALE
        )
        assert torch.equal(alone[:, 0], together[:, t])
    # A causal block needs no mask, and one mask may serve every batch row.
    causal = mask.clone()
    causal[:, :, 2, 10:20] = True
    unmasked = torch.ops.fastforward.exact_attention(query, key, value, None, SCALE)
    assert torch.equal(torch.ops.fastforward.exact_attention(query, key, value, causal[:1], SCALE), unmasked)


@needs_native
def test_a_query_that_sees_nothing_gets_zeros():
    query, key, value = _inputs(torch.float32, batch=1)
    mask = torch.zeros(1, 1, 5, 37, dtype=torch.bool)
    out = torch.ops.fastforward.exact_attention(query, key, value, mask, SCALE)
    assert torch.equal(out, torch.zeros(1, 5, HEADS, DIM))


@needs_native
def test_kernel_rejects_inputs_it_cannot_take():
    query, key, value = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.fastforward.exact_attention(query[..., :8], key[..., :8], value[..., :8], None, SCALE)
    with pytest.raises(RuntimeError, match="mask"):
        torch.ops.fastforward.exact_attention(query, key, value, torch.ones(2, 1, 5, 36, dtype=torch.bool), SCALE)


def test_the_kernel_choice_is_made_once_and_checked(monkeypatch):
    monkeypatch.setattr(attention, "_native", None)
    monkeypatch.setenv("FASTFORWARD_EXACT_ATTENTION", "fast")
    with pytest.raises(FastForwardError, match="choose native or chunked"):
        attention.native_kernel()
    monkeypatch.setenv("FASTFORWARD_EXACT_ATTENTION", "chunked")
    assert attention.native_kernel() is False
    monkeypatch.setenv("FASTFORWARD_EXACT_ATTENTION", "native")
    assert attention.native_kernel() is False  # decided: every forward of the process computes alike
    monkeypatch.setattr(attention, "_native", None)
    assert attention.native_kernel() is native.available()


def test_head_sizes_the_kernel_cannot_take_go_to_the_chunked_calls():
    """A head size past 256 (or not a multiple of 16) takes the chunked calls instead of failing."""
    fits = attention._native_fits
    assert fits(torch.zeros(1, 2, 3, 256)) and fits(torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16))
    assert not fits(torch.zeros(1, 2, 3, 512)) and not fits(torch.zeros(1, 2, 3, 40))
    assert not fits(torch.zeros(1, 2, 3, 64, dtype=torch.float16))
