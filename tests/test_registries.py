"""Decoders and objectives register themselves by name in a `fastforward.registry.Registry`: a new one is
a new file, an unknown name is an error listing the known ones, and a name is taken once. The package
exports every decoder class."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, fields

import pytest

import fastforward as ff
from fastforward.cli import build_parser
from fastforward.decoding.decoders import registry as decoders
from fastforward.decoding.decoders.base import Decoder
from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, option
from fastforward.training.objectives import NTP, OBJECTIVES, MultiTF, Objective, make_objective, register
from fastforward.training.objectives.registry import options


def test_every_objective_module_registers_itself():
    assert list(OBJECTIVES) == ["jacobi_forcing", "multitf", "ntp", "sbd", "setdlm"]  # by module name
    assert all(cls.name == name and issubclass(cls, Objective) for name, cls in OBJECTIVES.items())
    assert make_objective("ntp").describe() == {"name": "ntp"}


def test_an_unknown_objective_is_an_error_that_lists_the_known_ones():
    with pytest.raises(FastForwardError) as caught:
        make_objective("nope")
    assert str(caught.value) == f"unknown objective 'nope'; choose one of {', '.join(OBJECTIVES)}"
    assert "ntp, sbd, setdlm" in str(caught.value)


def test_an_unknown_decoder_is_an_error_that_lists_the_known_ones():
    with pytest.raises(FastForwardError, match="unknown decoder 'nope'; choose one of ar, "):
        decoders.spec("nope")


def test_a_new_objective_is_one_class_and_its_registration(scratch_registries):
    @register("ntp-twice")
    @dataclass
    class Twice(NTP):
        weight: float = option(2.0, "how much the NTP term counts")

    made = make_objective("ntp-twice", weight=3.0, max_block=4)  # options it lacks are ignored
    assert isinstance(made, Twice) and made.describe() == {"name": "ntp-twice", "weight": 3.0}
    assert "ntp-twice" in OBJECTIVES and list(OBJECTIVES)[-1] == "ntp-twice"  # this module sorts last
    assert options()["weight"].objectives == ("ntp-twice",)
    args = build_parser("train").parse_args(["train", "--objective", "ntp-twice", "--weight", "3", "--out", "x"])
    assert (args.objective, args.weight, args.min_block) == ("ntp-twice", 3.0, 2)


def test_a_new_decoder_is_one_dataclass_whose_option_fields_are_its_flags(scratch_registries):
    @decoders.register("ar-twice", summary="a test decoder")
    @dataclass(eq=False)
    class Twice(ff.ARDecoder):
        repeats: int = option(2, "ar-twice: how often", AT_LEAST_ONE)

    spec = decoders.spec("ar-twice")
    assert Twice.name == "ar-twice" and [k.name for k in spec.knobs] == ["temperature", "top_p", "seed", "repeats"]
    made = spec.create(repeats=3, temperature=0.5)
    assert isinstance(made, Twice) and (made.repeats, made.sampler) == (3, ff.Sampler(temperature=0.5))
    args = build_parser("generate").parse_args(["generate", "--decoder", "ar-twice", "--repeats", "3", "x"])
    assert args.repeats == 3
    with pytest.raises(FastForwardError, match="repeats must be >= 1, got 0"):
        Twice(repeats=0)
    with pytest.raises(TypeError, match="register a dataclass"):
        decoders.register("plain", summary="not a dataclass")(type("Plain", (Decoder,), {}))


def test_objective_options_shared_by_name_are_one_flag():
    assert options()["ntp_weight"].objectives == ("multitf", "sbd", "setdlm")
    assert options()["layouts"].knob.choices == ("systematic", "random", "both")
    assert "suffix_share" not in {f.name for f in fields(MultiTF) if f.init}  # SBD's, fixed off in MultiTF
    assert options()["suffix_share"].objectives == ("sbd",)


def test_a_name_is_registered_by_one_module_only(scratch_registries):
    with pytest.raises(TypeError, match="'ntp' of .* is already registered by fastforward.training.objectives.ntp"):
        register("ntp")(type("Other", (NTP,), {}))
    assert OBJECTIVES["ntp"] is NTP


def test_the_package_exports_every_decoder_class_and_every_name_it_lists():
    defined = {
        name
        for spec in decoders.specs().values()
        for name, value in vars(sys.modules[spec.cls.__module__]).items()
        if inspect.isclass(value) and issubclass(value, Decoder) and value.__module__ == spec.cls.__module__
    }
    assert "SetDiffusionDecoder" in defined and defined <= set(ff.__all__)
    assert all(getattr(ff, name) is not None for name in ff.__all__) and set(ff.__all__) <= set(dir(ff))
