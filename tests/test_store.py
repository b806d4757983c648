"""The store (`fastforward.model.store`), for quantized weights made once: the first load at a
setting keeps them, later loads read them back with the same bits, and a corrupt entry is said,
made again and never used. (Compiled steps in it: tests/test_compiled.py.)"""

import pytest
import torch

from fastforward.cpu import quantize
from fastforward.model import load_model, store
from fastforward.model.tiny import tiny_model

PROMPT = torch.tensor([[3, 17, 42, 8, 99, 5]])


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path / "home"))
    tiny_model(seed=0, init_std=0.5, hidden_size=64).save(tmp_path / "model")
    return str(tmp_path / "model")


@pytest.fixture
def quantizations(monkeypatch) -> list[str]:
    """The schemes `quantize` actually ran (a load from the store runs none)."""
    ran, real = [], quantize.quantize

    def counted(hf, scheme, *args, **kwargs):
        ran.append(scheme)
        return real(hf, scheme, *args, **kwargs)

    monkeypatch.setattr("fastforward.model.loading.quantize_linears", counted)
    return ran


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model.hf(input_ids=PROMPT).logits


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_second_load_reads_the_quantized_weights_back(saved, quantizations, scheme):
    first = load_model(saved, quantize=scheme, exact=True)
    second = load_model(saved, quantize=scheme, exact=True)
    assert quantizations == [scheme]
    assert torch.equal(logits(first), logits(second))
    load_model(saved, quantize=scheme, exact=False)  # another setting: another entry
    assert quantizations == [scheme, scheme]


def test_a_corrupt_entry_is_said_made_again_and_never_used(saved, quantizations, tmp_path, capsys):
    expected = logits(load_model(saved, quantize="int8"))
    (entry,) = (tmp_path / "home" / "quantized").glob("*.pt")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern inside the weights
    entry.write_bytes(bytes(data))
    capsys.readouterr()
    assert torch.equal(logits(load_model(saved, quantize="int8")), expected)
    assert quantizations == ["int8", "int8"]
    said = capsys.readouterr().err
    assert said.count("unusable") == 1 and "checksum" in said
    assert torch.equal(logits(load_model(saved, quantize="int8")), expected)
    assert quantizations == ["int8", "int8"]  # made again, then read


def test_new_source_weights_are_a_new_entry(saved, quantizations):
    old = logits(load_model(saved, quantize="int4"))
    tiny_model(seed=1, init_std=0.5, hidden_size=64).save(saved)  # the same folder, other weights
    new = logits(load_model(saved, quantize="int4"))
    assert not torch.equal(new, old) and torch.equal(logits(load_model(saved, quantize="int4")), new)
    assert quantizations == ["int4", "int4"]


def test_an_entry_made_by_other_code_is_replaced_not_kept_beside(saved, quantizations, tmp_path, monkeypatch):
    load_model(saved, quantize="int4")
    load_model(saved, quantize="int8")  # another setting: kept
    monkeypatch.setattr(store.transformers, "__version__", "0.0.0")  # as after an upgrade
    load_model(saved, quantize="int4")
    assert quantizations == ["int4", "int8", "int4"]
    assert len(list((tmp_path / "home" / "quantized").glob("*.pt"))) == 2


def test_the_same_weights_with_another_config_are_another_entry(tmp_path, monkeypatch, quantizations):
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path / "home"))
    for positions in (512, 24):  # RoPE: the weights files are the same bytes, the context is not
        tiny_model(seed=0, max_positions=positions).save(tmp_path / f"model-{positions}")
    contexts = [load_model(str(tmp_path / f"model-{p}"), quantize="int4").max_context for p in (512, 24)]
    assert contexts == [512, 24] and quantizations == ["int4", "int4"]
