import pytest
import torch

from fastforward.cpu import native
from fastforward.cpu.fusion import FusedMember, shared_input_groups
from fastforward.cpu.quantize import _fusable, quantize
from fastforward.cpu.smoothing import CALIBRATION_EXAMPLES, CALIBRATION_TOKENS, calibration_ids, smoothing_factors
from fastforward.cpu.w4a8 import W4A8Linear
from fastforward.model.tiny import tiny_model


def test_the_projections_that_read_one_input_are_found_per_layer():
    model = tiny_model(seed=0)
    groups = shared_input_groups(model.hf)
    layers = model.hf.config.num_hidden_layers
    assert sorted(map(sorted, groups)) == sorted(
        [[f"model.layers.{i}.self_attn.{p}_proj" for p in "kqv"] for i in range(layers)]
        + [[f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up")] for i in range(layers)]
    )


def test_fused_int8_projections_give_the_separate_layers_bits():
    fused, separate = tiny_model(seed=0, hidden_size=64), tiny_model(seed=0, hidden_size=64)
    calibration = [list(range(3, 50))]  # smoothing factors are shared within a group, fused or not
    quantize(fused.hf, "int8", calibration=calibration)
    quantize(separate.hf, "int8", fuse=False, calibration=calibration)
    assert isinstance(fused.hf.model.layers[0].self_attn.k_proj, FusedMember)
    assert not any(isinstance(m, FusedMember) for m in separate.hf.modules())
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        assert torch.equal(fused.hf(input_ids=ids).logits, separate.hf(input_ids=ids).logits)
        # a member called with another input than its group's last one computes it afresh
        attention = fused.hf.model.layers[0].self_attn
        x, y = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
        assert torch.equal(attention.q_proj(x), separate.hf.model.layers[0].self_attn.q_proj(x))
        assert torch.equal(attention.k_proj(y), separate.hf.model.layers[0].self_attn.k_proj(y))


def test_calibration_text_is_built_in():
    ids = calibration_ids(tiny_model(seed=0).tokenizer)
    assert len(ids) == CALIBRATION_EXAMPLES and all(0 < len(i) <= CALIBRATION_TOKENS for i in ids)


@pytest.mark.skipif(not native.available(), reason="needs x86 AVX2 or AVX-512 and a C++ compiler")
def test_fused_native_int4_projections_give_the_separate_layers_bits():
    fused, separate = tiny_model(seed=0, hidden_size=64), tiny_model(seed=0, hidden_size=64)
    quantize(fused.hf, "int4")
    quantize(separate.hf, "int4", fuse=False)
    assert isinstance(fused.hf.model.layers[0].mlp.up_proj, FusedMember)
    assert isinstance(fused.hf.model.layers[0].mlp.gate_proj.fused, W4A8Linear)
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        assert torch.equal(fused.hf(input_ids=ids).logits, separate.hf(input_ids=ids).logits)


def test_int4_on_pytorchs_kernel_stays_separate(monkeypatch):
    monkeypatch.setenv("FASTFORWARD_INT4_KERNEL", "pytorch")  # measured no faster fused
    model = tiny_model(seed=0, hidden_size=64)
    quantize(model.hf, "int4")
    assert not any(isinstance(m, FusedMember) for m in model.hf.modules())


def test_layers_whose_concatenation_takes_another_kernel_stay_separate(monkeypatch):
    # On PyTorch's int4 kernel a 576-wide and a 40-wide projection are int4 and int8 (40 is no multiple of
    # 16); their 616-wide concatenation would be int8 throughout: other bits, so no fusing. The native kernel
    # takes every width (padded to whole tiles), so there they fuse.
    layers = [torch.nn.Linear(64, 576), torch.nn.Linear(64, 40)]
    assert _fusable(layers, "int4") == native.available()
    monkeypatch.setenv("FASTFORWARD_INT4_KERNEL", "pytorch")
    assert not _fusable(layers, "int4")
    assert _fusable(layers, "int8")


def test_smoothing_factors_are_shared_by_the_layers_that_read_one_input():
    model = tiny_model(seed=0)
    groups = shared_input_groups(model.hf)
    factors = smoothing_factors(model.hf, groups, [list(range(3, 40))])
    linears = {name for name, m in model.hf.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(factors) == linears  # every layer is called by the calibration forward
    for members in groups:
        assert all(torch.equal(factors[name], factors[members[0]]) for name in members)
    output = factors["lm_head"]
    assert output.shape == (model.hf.config.hidden_size,) and bool((output > 0).all() & output.isfinite().all())
