"""A model carries its decoding defaults (decoding.json): read and checked against the decoder registry,
written atomically, found for a --model name, and used by `generate` when no --decoder is given."""

import json
import math

import pytest

from fastforward.cli import build_parser, main
from fastforward.cli.decoding import chosen_decoder, decoder_knobs, default_decoder
from fastforward.cli.serve import serve_knobs
from fastforward.decoding.model_defaults import (
    FILE,
    DecodingDefaults,
    model_decoding_defaults,
    read_decoding_defaults,
    write_decoding_defaults,
)
from fastforward.errors import FastForwardError
from fastforward.model.tiny import tiny_model

JACOBI = {"decoder": "jacobi", "options": {"block_size": 4}, "measured": "a test"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model(seed=0, init_std=0.5).save(path)
    return path


def with_defaults(directory, record) -> None:
    (directory / FILE).write_text(json.dumps(record))


def test_defaults_are_written_read_back_and_typed(tmp_path):
    written = DecodingDefaults("sbd-verified", {"block_size": 8, "gamma": math.inf}, "measured so")
    path = write_decoding_defaults(tmp_path, written)
    assert json.loads(path.read_text())["options"] == {"block_size": 8, "gamma": "inf"}  # strict JSON
    assert [p.name for p in tmp_path.iterdir()] == [FILE]  # no temporary file left
    read = read_decoding_defaults(tmp_path)
    assert read == written and read.describe() == "sbd-verified --block-size 8 --gamma inf"
    with_defaults(tmp_path, {"decoder": "sbd", "options": {"gamma": 1, "first_token_from_ntp": True}})
    read = read_decoding_defaults(tmp_path)
    assert read.options == {"gamma": 1.0, "first_token_from_ntp": True} and isinstance(read.options["gamma"], float)
    assert read.describe() == "sbd --gamma 1.0 --first-token-from-ntp" and read.measured == ""
    assert read_decoding_defaults(tmp_path / "nothing here") is None


BAD = {
    "not JSON": ("{", "not readable JSON"),
    "not an object": ([], "a JSON list, not an object"),
    "a misspelt field": ({"decoder": "ar", "option": {}}, "unknown field(s) option"),
    "no decoder": ({"options": {}}, '"decoder" must name a decoder'),
    "an unknown decoder": ({"decoder": "fast"}, "unknown decoder 'fast'; choose one of"),
    "options not an object": ({"decoder": "jacobi", "options": [8]}, '"options" must be an object'),
    "an option the decoder does not take": (
        {"decoder": "lookup", "options": {"block_size": 16}},
        "the 'lookup' decoder takes no option 'block_size'",
    ),
    "a value out of bounds": ({"decoder": "jacobi", "options": {"block_size": 0}}, "block size must be > 0"),
    "a value of another type": ({"decoder": "jacobi", "options": {"block_size": 8.5}}, "takes int values"),
    "text that is no number": ({"decoder": "jacobi", "options": {"block_size": "eight"}}, "takes int values"),
}


@pytest.mark.parametrize("record, problem", BAD.values(), ids=BAD.keys())
def test_a_malformed_file_is_a_one_line_error_naming_it(tmp_path, record, problem):
    (tmp_path / FILE).write_text(record if isinstance(record, str) else json.dumps(record))
    with pytest.raises(FastForwardError, match="fix the file or remove it") as error:
        read_decoding_defaults(tmp_path)
    said = str(error.value)
    assert said.startswith(f"{tmp_path / FILE}: ") and problem in said and "\n" not in said


def test_bad_defaults_are_never_written(tmp_path):
    with pytest.raises(FastForwardError, match="block size must be > 0"):
        write_decoding_defaults(tmp_path, DecodingDefaults("jacobi", {"block_size": 0}))
    assert list(tmp_path.iterdir()) == []


def test_a_model_name_finds_its_own_defaults(tmp_path, monkeypatch):
    assert model_decoding_defaults("smollm2-135m") is None  # the GGUF preset has no directory: the default
    shipped = model_decoding_defaults("smollm2-135m-jf-arithmetic")
    assert (shipped.decoder, shipped.options) == ("jacobi", {"block_size": 8})
    assert model_decoding_defaults("demo-jf").decoder == "jacobi" and model_decoding_defaults("demo-ntp") is None
    assert model_decoding_defaults("no-such-model") is None  # loading it says what is wrong
    (tmp_path / "model").mkdir()
    (tmp_path / "adapter").mkdir()
    with_defaults(tmp_path / "model", JACOBI)
    monkeypatch.chdir(tmp_path)
    assert model_decoding_defaults("model").decoder == "jacobi"  # relative to the working directory
    assert model_decoding_defaults("model", cwd="/") is None  # ... or to the one given
    assert model_decoding_defaults("model", "adapter").decoder == "jacobi"  # an adapter without its own
    with_defaults(tmp_path / "adapter", {"decoder": "ar"})
    assert model_decoding_defaults("model", "adapter").decoder == "ar"  # the adapter's comes first


def test_options_given_override_the_defaults_and_one_it_does_not_take_names_it():
    own = DecodingDefaults("jacobi", {"block_size": 8})
    assert default_decoder({}, own, "lookup") == ("jacobi", {"block_size": 8})
    assert default_decoder({"block_size": 12, "seed": 1}, own, "lookup") == ("jacobi", {"block_size": 12, "seed": 1})
    assert default_decoder({"lookup_tokens": 4}, None, "lookup") == ("lookup", {"lookup_tokens": 4})
    with pytest.raises(FastForwardError, match="--gamma 0.5 does not apply to the 'jacobi' decoder, this model's"):
        default_decoder({"gamma": 0.5}, own, "lookup")
    with pytest.raises(FastForwardError, match="--block-size 4 does not apply to the 'lookup' decoder, the default"):
        default_decoder({"block_size": 4}, None, "lookup")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_choose_from_the_command_line_and_the_models_file(saved, command):
    knobs = decoder_knobs if command == "generate" else serve_knobs
    fallback = {"generate": "lookup", "serve": "ar"}[command]

    def chosen(*flags: str) -> tuple[str, dict]:
        args = build_parser(command).parse_args([command, "--model", str(saved), *flags])
        return chosen_decoder(args, knobs(args), fallback)

    assert chosen() == (fallback, {})
    with_defaults(saved, JACOBI)
    try:
        assert chosen() == ("jacobi", {"block_size": 4})
        assert chosen("--block-size", "2") == ("jacobi", {"block_size": 2})
        assert chosen("--decoder", "ar") == ("ar", {})
        assert chosen("--decoder", "jacobi") == ("jacobi", {})  # a decoder named takes its own defaults
    finally:
        (saved / FILE).unlink()


def run_generate(saved, capsys, *flags: str) -> dict:
    """generate's --json record of one prompt."""
    argv = ["generate", "--model", str(saved), "--quantize", "none", "--max-new-tokens", "12", *flags]
    assert main([*argv, "--no-engine", "--threads", "1", "Tom has 3 apples"]) == 0
    said = capsys.readouterr()
    return json.loads(said.out) if "--json" in flags else {"report": said.err}


def test_generate_decodes_with_the_models_default_and_gives_ars_tokens(saved, capsys):
    """jacobi is lossless: the model's default changes the forwards, not the tokens; --decoder overrides it."""
    with_defaults(saved, JACOBI)
    try:
        own = run_generate(saved, capsys, "--json")
        ar = run_generate(saved, capsys, "--json", "--decoder", "ar")
        assert (own["decoder"], ar["decoder"]) == ("jacobi", "ar") and own["token_ids"] == ar["token_ids"]
        assert own["stats"]["queries"] > ar["stats"]["queries"]  # blocks of drafts ran
        assert run_generate(saved, capsys)["report"].startswith("[jacobi: 12 tokens")
    finally:
        (saved / FILE).unlink()
    assert run_generate(saved, capsys)["report"].startswith("[lookup: ")  # without the file: generate's default


def test_a_bad_decoding_json_stops_generate_with_exit_code_2(saved, capsys):
    with_defaults(saved, {"decoder": "jacobi", "options": {"gamma": 0.5}})
    try:
        assert main(["generate", "--model", str(saved), "--no-engine", "hi"]) == 2
    finally:
        (saved / FILE).unlink()
    said = capsys.readouterr().err.strip()
    assert said.startswith("fastforward generate: error: ") and "takes no option 'gamma'" in said
    assert str(saved / FILE) in said and "\n" not in said
