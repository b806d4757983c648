"""The decoder registry: one declaration per decoder feeds the CLI, the API, sweeps and docs/decoders.md."""

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from fastforward.api import build_decoder
from fastforward.cli import build_parser, main
from fastforward.decoding.decoders import registry
from fastforward.decoding.decoders.lookup import PromptLookupDecoder
from fastforward.decoding.decoders.sbd_slide import SlidingSBDDecoder
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.evaluation.evaluate import parse_sweep
from fastforward.model.tiny import tiny_model
from fastforward.options import Knob, knobs_of

DECODERS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "decoders.md"


def test_every_decoder_builds_with_its_defaults():
    for name, spec in registry.specs().items():
        decoder = build_decoder(name)
        assert decoder.name == name
        assert spec.knobs == tuple(spec.knob(k.name) for k in spec.knobs)


def test_decoders_page_table_is_the_registry_table():
    """docs/decoders.md carries `fastforward decoders`' output between its markers: paste it there again
    after changing a decoder or a knob."""
    text = DECODERS_PAGE.read_text()
    block = re.search(r"<!-- decoders:start -->\n(.*?)\n<!-- decoders:end -->", text, re.S)
    assert block is not None and block.group(1) == registry.knob_table()


def test_cli_has_a_flag_for_every_knob():
    defaults = build_parser().parse_args(["generate", "x"])  # every flag left out
    assert defaults.decoder is None and not set(vars(defaults)) & set(registry.all_knobs())
    for knob in registry.all_knobs().values():
        args = ["generate", "--decoder", next(s for s in registry.specs() if registry.spec(s).knob(knob.name))]
        value = "true" if knob.type is bool else str(knob.default)
        args += [knob.flag] if knob.type is bool else [knob.flag, value]
        parsed = build_parser().parse_args([*args, "x"])
        assert knob.name in vars(parsed)


def test_options_that_do_not_apply_are_errors_unless_neutral(capsys):
    build_decoder("ar", block_size=16, gamma=0.35)  # defaults of other decoders' knobs: accepted
    with pytest.raises(FastForwardError, match="does not apply to the 'ar' decoder"):
        build_decoder("ar", gamma=-1)
    with pytest.raises(FastForwardError, match="unknown decoder option"):
        build_decoder("sbd", bogus=1)
    with pytest.raises(FastForwardError, match="unknown value 'bogus'"):
        build_decoder("sbd", policy="bogus")
    assert main(["generate", "--decoder", "jacobi", "--policy", "confidence", "hi"]) == 2
    assert "does not apply to the 'jacobi' decoder" in capsys.readouterr().err


def refused(knob: Knob) -> Any:
    """A value the knob refuses: not among its choices, or outside its bound."""
    if knob.choices is not None:
        return "bogus"
    return next(value for value in (-1, 0, 1.5) if not knob.bound.holds(value))


@pytest.mark.parametrize("name", list(registry.specs()))
def test_decoder_classes_refuse_what_build_decoder_refuses(name):
    """Every option with choices or bounds refuses a bad value made through the class itself, in the words
    `build_decoder` (and so the CLI and the server) use; the classes once took any value."""
    spec = registry.spec(name)
    checked = 0
    for f in fields(spec.cls):
        knobs = knobs_of(f)
        if len(knobs) != 1 or (knobs[0].choices is None and knobs[0].bound is None):
            continue  # several knobs build the field (its own class checks it), or nothing to refuse
        knob, bad = knobs[0], refused(knobs[0])
        words = f"unknown value {bad!r}" if knob.choices else f"must be {knob.bound.rule}, got {bad}"
        with pytest.raises(FastForwardError, match=re.escape(words)):
            spec.cls(**{f.name: bad})
        with pytest.raises(FastForwardError, match=re.escape(words)):
            build_decoder(name, **{knob.name: bad})
        checked += 1
    assert checked or name == "ar"


def test_rules_between_options_hold_for_the_classes_too(capsys):
    with pytest.raises(FastForwardError, match="sbd-slide needs a block of at least 2"):
        SlidingSBDDecoder(block_size=1)
    with pytest.raises(FastForwardError, match=re.escape("min match (5) must be <= max match (3)")):
        PromptLookupDecoder(min_match=5, max_match=3)
    assert main(["generate", "--decoder", "lookup", "--min-match", "5", "--max-match", "3", "hi"]) == 2
    assert "min match (5) must be <= max match (3)" in capsys.readouterr().err
    with pytest.raises(FastForwardError, match="temperature must be >= 0, got nan"):
        Sampler(temperature=float("nan"))  # once taken: NaN < 0 is false


def test_sweep_values_are_typed_and_checked_by_the_registry():
    assert parse_sweep("draft-init=repeat,random") == ("draft_init", ["repeat", "random"])
    assert parse_sweep("gamma=inf") == ("gamma", [float("inf")])
    with pytest.raises(FastForwardError, match="block size must be > 0"):
        parse_sweep("block-size=4,0")


def test_decoders_command_prints_the_table(capsys):
    assert main(["decoders"]) == 0
    assert capsys.readouterr().out.strip() == registry.knob_table()


def test_generate_picks_lookup_and_an_option_it_does_not_take_names_it():
    from fastforward.cli.decoding import default_decoder

    def chosen(knobs: dict) -> str:
        """The decoder generate picks for a model without decoding.json."""
        return default_decoder(knobs, None, "lookup")[0]

    assert chosen({}) == "lookup" and chosen({"lookup_tokens": 4}) == "lookup"
    assert chosen({"temperature": 0.7, "top_p": 0.9, "seed": 1}) == "lookup"  # lookup samples too
    assert chosen({"block_size": 16}) == "lookup"  # another decoder's option at its neutral default
    with pytest.raises(FastForwardError, match="--block-size 4 does not apply to the 'lookup' decoder, the default"):
        chosen({"block_size": 4})


def test_generate_with_another_decoders_option_names_the_decoder_the_user_gets(capsys):
    """`generate --block-size 4 PROMPT` once answered that the option does not apply to 'ar', a decoder
    the user never chose; the default is lookup. Said before any model loads."""
    assert main(["generate", "--block-size", "4", "--model", "no-such-model", "x"]) == 2
    said = capsys.readouterr().err
    assert "'lookup' decoder, the default" in said and "'ar'" not in said
    assert "--decoder (jacobi, " in said and "sbd" in said


def test_generate_reports_the_decoder_it_chose(tmp_path, capsys):
    tiny_model(seed=0).save(tmp_path / "m")
    assert main(["generate", "--model", str(tmp_path / "m"), "--max-new-tokens", "4", "1 2 3"]) == 0
    assert capsys.readouterr().err.startswith("[lookup: 4 tokens")


def test_precision_defaults_follow_the_device():
    """The CPU's defaults (int4, --exact) are CPU kernels: a CUDA --device gets bfloat16 without them,
    and a flag given keeps its value on either."""
    from fastforward.cli import resolve_precision

    def resolved(*argv: str) -> tuple:
        args = build_parser().parse_args(["generate", *argv, "x"])
        resolve_precision(args)
        return args.dtype, args.quantize, args.exact

    assert resolved() == ("float32", "int4", True)
    assert resolved("--device", "cuda") == ("bfloat16", "none", False)
    assert resolved("--device", "cuda:1", "--dtype", "float32") == ("float32", "none", False)
    assert resolved("--quantize", "int8", "--no-exact") == ("float32", "int8", False)


def test_serve_compiles_by_default_where_it_can_and_generate_does_not(monkeypatch, capsys):
    """A server lives long enough for compiled steps to pay back their start-up; a one-shot generate does not."""
    from fastforward.cli import resolve_precision
    from fastforward.cpu import compiled

    def resolved(command: str, *argv: str) -> bool:
        args = build_parser().parse_args([command, *argv] + (["x"] if command == "generate" else []))
        resolve_precision(args)
        return args.compile

    monkeypatch.setattr(compiled, "unavailable", lambda device_type: None)
    assert resolved("serve") is True and resolved("generate") is False
    assert resolved("serve", "--no-compile") is False and resolved("generate", "--compile") is True
    assert resolved("serve", "--device", "cuda") is False  # CUDA graphs instead
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(compiled, "unavailable", lambda device_type: "needs a C++ compiler")
    assert resolved("serve") is False
    said = capsys.readouterr().err
    assert "fastforward serve: decoding steps run eagerly: compiling them needs a C++ compiler" in said
