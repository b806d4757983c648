"""`Precision`, declared once: the CLI's precision flags are its fields, `precision(args)` gives the value
they ask for, and `load_model` loads the same model from that value as from its fields by name."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest
import torch

from fastforward.cli import build_parser, precision, resolve_precision
from fastforward.errors import FastForwardError
from fastforward.model import ON_GPU, Precision, load_model
from fastforward.model.tiny import tiny_model

# Every command that loads a model to decode, with what its command line needs besides.
COMMANDS = {
    "generate": ["x"],
    "serve": [],
    "eval": ["--model", "m", "--task", "arithmetic"],
    "infill": ["--model", "m", "--prefix", "a", "--suffix", "b", "--middle-tokens", "4"],
    "roofline": [],
    "demo": [],
}


def parsed(command: str, *argv: str):
    args = build_parser(command).parse_args([command, *argv, *COMMANDS[command]])
    resolve_precision(args)
    return args


@pytest.fixture(autouse=True)
def _no_compiling(monkeypatch):
    from fastforward.cpu import compiled

    monkeypatch.setattr(compiled, "unavailable", lambda device_type: "not in these tests")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_precision_flag_is_a_field_and_its_default_the_commands(command):
    args = parsed(command)
    value = precision(args)
    flags = {f.name for f in fields(Precision)} & set(vars(args))
    assert {"dtype", "quantize", "exact", "adapter"} <= flags
    assert all(getattr(value, name) == getattr(args, name) for name in flags)
    assert all(getattr(value, f.name) == f.default for f in fields(Precision) if f.name not in flags)
    for name in ("dtype", "quantize", "exact"):  # the command's CPU defaults are a Precision too
        assert getattr(value, name) == getattr(args.cpu_precision, name)


def test_a_full_command_sets_every_field_from_its_flag():
    argv = ["--dtype", "bfloat16", "--quantize", "int8", "--no-exact", "--attention", "flex", "--compile"]
    value = precision(parsed("generate", *argv, "--no-cuda-graphs", "--adapter", "some/adapter"))
    assert value == Precision("bfloat16", "int8", False, "flex", True, False, "some/adapter")
    assert {f.name for f in fields(Precision)} <= set(vars(parsed("generate")))


def test_a_gpu_device_takes_on_gpu_for_what_the_command_leaves_unset():
    assert precision(parsed("generate", "--device", "cuda")) == ON_GPU
    assert precision(parsed("generate", "--device", "cuda", "--quantize", "int8")).quantize == "int8"


def test_a_precision_is_checked_when_made_and_cannot_change():
    for options, message in [
        ({"dtype": "float8"}, "unknown dtype 'float8'; choose one of float32, bfloat16, float16"),
        ({"quantize": "int3"}, "unknown quantization 'int3'"),
        ({"attention": "eager"}, "unknown attention 'eager'"),
    ]:
        with pytest.raises(FastForwardError, match=message):
            Precision(**options)
    assert Precision(dtype=torch.bfloat16) == Precision(dtype="bfloat16")
    with pytest.raises(FrozenInstanceError):
        Precision().dtype = "bfloat16"


def test_load_model_takes_the_value_or_its_fields_by_name(tmp_path):
    tiny_model(seed=0).save(tmp_path / "m")
    path = str(tmp_path / "m")
    flags = precision(parsed("generate", "--model", path, "--dtype", "bfloat16", "--quantize", "none", "--no-exact"))
    from_flags = load_model(path, precision=flags)
    by_name = load_model(path, dtype="bfloat16")
    assert from_flags.dtype == by_name.dtype == torch.bfloat16
    assert from_flags.hf.config._attn_implementation == by_name.hf.config._attn_implementation == "sdpa"
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(from_flags.hf(ids).logits, by_name.hf(ids).logits)
    exact = load_model(path, precision=Precision(dtype="bfloat16"), exact=True)  # fields override the value
    assert exact.batch_invariant and exact.dtype == torch.bfloat16
    with pytest.raises(FastForwardError, match="unknown dtype"):
        load_model(path, dtype="float8")
    with pytest.raises(TypeError):
        load_model(path, dtypes="float32")  # a misspelt option is not silently dropped


def test_commands_that_train_or_collect_take_precisions_dtype_and_adapter():
    train = build_parser("train").parse_args(["train", "--out", "x"])
    collect = build_parser("trajectories").parse_args(["trajectories", "--out", "x", "--adapter", "a"])
    assert train.dtype == collect.dtype == Precision().dtype
    assert precision(collect) == Precision(adapter="a")
