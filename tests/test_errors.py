"""Bad input gets a clear FastForwardError (exit code 2 on the CLI), never a traceback."""

import json

import pytest

from fastforward.api import build_decoder
from fastforward.cli import main
from fastforward.decoding.decoders import ARDecoder, SBDDecoder
from fastforward.errors import FastForwardError
from fastforward.model import load_model
from fastforward.model.tiny import tiny_model


@pytest.fixture(scope="module")
def saved_without_mask(tmp_path_factory):
    path = tmp_path_factory.mktemp("plain")
    tiny_model(init_std=0.5).save(path)
    return path


def test_unknown_model(capsys):
    assert main(["generate", "--model", "no/such/model", "hello"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no/such/model'" in err and "smollm2-135m" in err


@pytest.mark.parametrize("size", [0, -3])
def test_block_size_must_be_positive(size, capsys):
    with pytest.raises(FastForwardError, match="block size must be > 0"):
        build_decoder("sbd", block_size=size)
    assert main(["generate", "--decoder", "sbd", "--block-size", str(size), "hi"]) == 2
    assert "block size must be > 0" in capsys.readouterr().err


def test_negative_gamma_and_temperature():
    with pytest.raises(FastForwardError, match=">= 0"):
        build_decoder("sbd", gamma=-0.5)
    with pytest.raises(FastForwardError, match="temperature"):
        build_decoder("ar", temperature=-1)
    with pytest.raises(FastForwardError, match="unknown decoder"):
        build_decoder("medusa")


def test_prompt_longer_than_context(tiny):
    too_long = [5] * tiny.max_context
    with pytest.raises(FastForwardError, match="context is 512"):
        ARDecoder().generate(tiny, [too_long], max_new_tokens=4)


def test_generation_stops_at_the_context_length(tiny):
    gen = ARDecoder().generate(tiny, [[5] * (tiny.max_context - 3)], max_new_tokens=50)[0]
    assert len(gen.token_ids) <= 3


def test_bad_max_new_tokens_and_empty_prompt(tiny):
    with pytest.raises(FastForwardError, match="max_new_tokens"):
        ARDecoder().generate(tiny, [[5, 6]], max_new_tokens=0)
    with pytest.raises(FastForwardError, match="empty"):
        ARDecoder().generate(tiny, [[]], max_new_tokens=3)


def test_sbd_on_a_checkpoint_without_mask_token(saved_without_mask, capsys):
    model = load_model(str(saved_without_mask))
    assert model.mask_token_id is None
    with pytest.raises(FastForwardError, match="no mask token|has none"):
        SBDDecoder(4).generate(model, [[5, 6, 7]], max_new_tokens=4)
    assert main(["generate", "--model", str(saved_without_mask), "--decoder", "sbd", "hi"]) == 2
    assert "train it first" in capsys.readouterr().err


def test_mask_token_survives_save_and_load(tmp_path):
    model = tiny_model(init_std=0.5)
    mask = model.add_mask_token()
    model.save(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.mask_token_id == mask
    assert loaded.tokenizer.convert_tokens_to_ids("<|mask|>") == mask


def test_generate_cli_json(saved_without_mask, capsys):
    args = ["generate", "--model", str(saved_without_mask), "--dtype", "float32", "--max-new-tokens", "5", "--json"]
    assert main([*args, "a", "b"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    record = json.loads(lines[0])
    assert set(record) >= {"text", "token_ids", "stats"}
    assert {"nfe", "tokens", "tpf", "seconds", "tps"} <= set(record["stats"])
    assert record["stats"]["tokens"] == len(record["token_ids"]) <= 5
