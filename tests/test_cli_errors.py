"""The CLI's answers to broken models, bad stdin, bad flags and Ctrl-C: a clear message and an exit code."""

import io
import json
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.utils import logging as hf_logging

from fastforward.cli import generate as generate_cli
from fastforward.cli import main
from fastforward.decoding.decoders import ARDecoder
from fastforward.errors import FastForwardError
from fastforward.evaluation.evaluate import compare
from fastforward.model import load_model, presets, resolve_model_path
from fastforward.model.tiny import tiny_model
from fastforward.tasks import get_task


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model(init_std=0.5).save(path)
    return path


def generate(model, *argv):
    return main(["generate", "--model", str(model), "--dtype", "float32", "--max-new-tokens", "3", *argv])


def set_stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


# ---- broken models ------------------------------------------------------------------------------
def test_text_file_named_gguf(tmp_path, capsys):
    fake = tmp_path / "fake.gguf"
    fake.write_text("hello, not a model\n")
    assert generate(fake, "hi") == 2
    assert "fake.gguf is not a GGUF file (it starts with b'hell'" in capsys.readouterr().err


def test_truncated_gguf(tmp_path, capsys):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert generate(truncated, "hi") == 2
    assert "could not load a causal LM from the GGUF file" in capsys.readouterr().err


def test_directory_without_config(tmp_path, capsys):
    assert generate(tmp_path, "hi") == 2
    assert f"{tmp_path} has no config.json, so it is not a model directory" in capsys.readouterr().err


@pytest.mark.parametrize("text, problem", [("{not json", "not valid JSON"), ("[1, 2]", "a JSON list")])
def test_corrupt_config(tmp_path, text, problem, capsys):
    (tmp_path / "config.json").write_text(text)
    assert generate(tmp_path, "hi") == 2
    err = capsys.readouterr().err
    assert "config.json is corrupt" in err and problem in err


# ---- stdin --------------------------------------------------------------------------------------
def test_stdin_not_utf8(saved, monkeypatch, capsys):
    set_stdin(monkeypatch, b"fine\ncaf\xe9 au lait\n")
    assert generate(saved, "--json") == 2
    assert "stdin line 2 is not UTF-8 text (byte 0xe9 at byte offset 3)" in capsys.readouterr().err


@pytest.mark.parametrize("data", [b"", b"\n  \r\n"])
def test_no_prompts(data, monkeypatch, capsys):
    set_stdin(monkeypatch, data)
    assert generate("no/model/needed", "--json") == 2
    assert "no prompts: give them as arguments or one per line on stdin" in capsys.readouterr().err


def test_prompts_from_stdin(saved, monkeypatch, capsys):
    set_stdin(monkeypatch, "first\r\n\nsecond é\n".encode())
    assert generate(saved, "--json") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == ["first", "second é"]


# ---- flags --------------------------------------------------------------------------------------
EVAL = ["eval", "--model", "no/model/needed", "--task", "arithmetic"]
GENERATE = ["generate", "--model", "no/model/needed", "hi"]


@pytest.mark.parametrize("argv", [GENERATE, EVAL])
def test_device_not_available(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*argv, "--device", "cuda"]) == 2
    assert "device 'cuda' is not available" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [GENERATE, EVAL])
def test_unknown_device(argv, capsys):
    assert main([*argv, "--device", "bogus"]) == 2
    assert "unknown device 'bogus': use cpu, cuda, cuda:N or mps" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [GENERATE, EVAL])
@pytest.mark.parametrize("size", ["0", "-3"])
def test_batch_size_must_be_positive(argv, size, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--batch-size", size])
    assert exit_.value.code == 2
    assert f"argument --batch-size: must be at least 1, got {size}" in capsys.readouterr().err


# ---- Ctrl-C -------------------------------------------------------------------------------------
def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


def test_interrupt_while_building_the_parser(monkeypatch, capsys):
    monkeypatch.setattr("fastforward.cli.build_parser", interrupted)  # it imports torch and transformers
    assert main(["generate", "hi"]) == 130
    assert capsys.readouterr().err == "fastforward: interrupted\n"


def test_interrupt_while_loading(monkeypatch, capsys):
    monkeypatch.setattr(generate_cli, "load_model", interrupted)
    assert main(GENERATE) == 130
    assert capsys.readouterr().err == "fastforward generate: interrupted\n"


def test_interrupt_while_decoding(saved, monkeypatch, capsys):
    calls = []
    real = ARDecoder.prefilled

    def second_prefill_interrupted(self, *args, **kwargs):  # one prompt at a time: the second one's
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ARDecoder, "prefilled", second_prefill_interrupted)
    assert generate(saved, "--decoder", "ar", "--json", "one", "two", "three") == 130
    captured = capsys.readouterr()
    assert [json.loads(line)["prompt"] for line in captured.out.splitlines()] == ["one"]
    assert "1 of 3 prompts completed before the interrupt" in captured.err
    assert captured.err.endswith("fastforward generate: interrupted\n")


def test_interrupt_mid_decoding_prints_what_was_generated(saved, monkeypatch, capsys):
    from fastforward.decoding.runtime import Session

    steps = []
    real = Session.advance

    def fourth_step_interrupted(self, keep):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real(self, keep)

    monkeypatch.setattr(Session, "advance", fourth_step_interrupted)
    argv = ["generate", "--model", str(saved), "--decoder", "ar", "--dtype", "float32", "--max-new-tokens", "20"]
    assert main([*argv, "--json", "one"]) == 130
    captured = capsys.readouterr()
    record = json.loads(captured.out.splitlines()[0])
    # the prefill's token and one per step: the fourth step committed its token before it was interrupted
    assert record["finish_reason"] == "interrupted" and len(record["token_ids"]) == 5
    assert "0 of 1 prompts completed before the interrupt" in captured.err


# ---- noise --------------------------------------------------------------------------------------
def test_local_load_and_save_draw_no_bars(saved, tmp_path, capsys):
    model = load_model(str(saved))
    model.save(tmp_path / "copy")
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err
    assert hf_logging.is_progress_bar_enabled()  # silenced only for the load and the save


def test_preset_conversion_says_so_once(tmp_path, monkeypatch, capsys):
    tiny = tiny_model()
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path))
    monkeypatch.setattr(presets, "_preset_gguf", lambda name: tmp_path / "Tiny.Q4.gguf")
    monkeypatch.setattr(presets, "load_gguf", lambda path: (tiny.hf, tiny.tokenizer))
    target = resolve_model_path("smollm2-135m")
    assert (target / "config.json").exists()
    err = capsys.readouterr().err
    assert err == f"fastforward: converting Tiny.Q4.gguf to safetensors in {target} (once, ~30 s)\n"
    assert resolve_model_path("smollm2-135m") == target
    assert capsys.readouterr().err == ""


def test_eval_progress_bar_only_on_terminals(saved, capsys):
    model = load_model(str(saved))
    compare(model, get_task("arithmetic"), {}, n=1, max_new_tokens=2, warmup=False, progress=True, desc="bar")
    assert "bar" not in capsys.readouterr().err  # stderr is not a terminal here


def test_train_out_that_is_a_file(saved, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n')
    out = tmp_path / "existing_file.txt"
    out.write_text("keep me\n")
    assert main(["train", "--model", str(saved), "--data", str(data), "--out", str(out), "--steps", "1"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"


@settings(max_examples=75, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_stdin_gives_prompts_or_a_clear_error(monkeypatch, data):
    set_stdin(monkeypatch, data)
    try:
        prompts = generate_cli.read_prompts()
    except FastForwardError as exc:
        assert "stdin line" in str(exc)
    else:
        assert all(isinstance(p, str) and p.strip() for p in prompts)
