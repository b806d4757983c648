"""One option system (`fastforward.options`): decoders, objectives, tasks, reveal policies and recipes declare
their options as dataclass fields with default, help and bound, and a bad value is refused, in the same
words, however the object is made: the Python class, the function that makes it by name, the CLI flag,
and for decoders the server's request field."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

import httpx
import pytest

from fastforward.api import build_decoder
from fastforward.cli import build_parser, main
from fastforward.decoding.decoders import SBDDecoder
from fastforward.decoding.policies import POLICIES, ConfidenceBounded, EntropyBounded, Factor, Threshold, make_policy
from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, FRACTION, Knob, at_least, check_options, option, options_of, within
from fastforward.tasks import TASKS, ArithmeticTask, JsonlTask, get_task, task_options
from fastforward.training.objectives import OBJECTIVES, SBD, make_objective
from fastforward.training.objectives.registry import options


def refused(capsys, argv: list[str]) -> str:
    """The message of a command line refused as a user's mistake (exit status 2)."""
    assert main(argv) == 2
    return capsys.readouterr().err


def post(url: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 2, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


# ---- the declarations -------------------------------------------------------------------------------
def test_a_declared_option_is_checked_at_construction_and_read_back_as_a_knob():
    @dataclass
    class Thing:
        count: int = option(2, "how many", AT_LEAST_ONE)
        share: float = option(0.5, "how much", FRACTION)
        mode: str = option("a", "which", choices=("a", "b"))
        path: str | None = option(None, "where", kind=str)

        def __post_init__(self) -> None:
            check_options(self)

    assert options_of(Thing) == {
        "count": Knob("count", int, 2, "how many", bound=AT_LEAST_ONE),
        "share": Knob("share", float, 0.5, "how much", bound=FRACTION),
        "mode": Knob("mode", str, "a", "which", choices=("a", "b")),
        "path": Knob("path", str, None, "where"),
    }
    with pytest.raises(FastForwardError, match=re.escape("count must be >= 1, got 0")):
        Thing(count=0)
    with pytest.raises(FastForwardError, match=re.escape("share must be in [0, 1], got nan")):
        Thing(share=math.nan)
    with pytest.raises(FastForwardError, match="mode: unknown value 'c'; choose one of a, b"):
        Thing(mode="c")
    assert Thing(path="x").path == "x"


def test_text_is_read_as_the_options_type_and_bools_take_only_bool_words():
    knob = Knob("strict", bool, True, "grade strictly")
    assert [knob.parse(text) for text in ("yes", "Off", "1", " false ")] == [True, False, True, False]
    with pytest.raises(FastForwardError, match="--strict takes bool values, got 'maybe'"):
        knob.parse("maybe")  # once read as False
    count = Knob("max_ops", int, 4, "most operations", bound=within(1, 6))
    assert count.parse("3", "task option max_ops") == 3
    with pytest.raises(FastForwardError, match=re.escape("max ops must be in [1, 6], got 9 (task option max_ops)")):
        count.parse("9", "task option max_ops")
    assert at_least(10).rule == ">= 10" and not at_least(10).holds(9)


# ---- decoders -----------------------------------------------------------------------------------------
def test_a_decoder_refuses_a_bad_value_from_python_and_the_cli(capsys):
    words = "block size must be > 0, got 0"
    with pytest.raises(FastForwardError, match=words):
        SBDDecoder(block_size=0)
    with pytest.raises(FastForwardError, match=re.escape(f"{words} (--block-size)")):
        build_decoder("sbd", block_size=0)
    assert f"{words} (--block-size)" in refused(capsys, ["generate", "--decoder", "sbd", "--block-size", "0", "hi"])


def test_a_server_request_field_is_refused_in_the_same_words(served):
    """A decoder's option and a policy's bound, each a 400 naming the field; the server serves on."""
    response = post(served[1], decoder="sbd", block_size=0)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "block size must be > 0, got 0 (field 'block_size')"
    response = post(served[1], decoder="sbd", policy="threshold", gamma=-1.0)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "gamma must be >= 0, got -1.0 (field 'gamma')"
    assert post(served[1], decoder="sbd", block_size=2).status_code == 200


# ---- reveal policies ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_refuses_a_negative_or_nan_bound_when_it_is_made(name):
    (field_name,) = options_of(POLICIES[name])
    for bad in (-1.0, math.nan):
        with pytest.raises(FastForwardError, match=f"{field_name} must be >= 0, got {bad}"):
            POLICIES[name](bad)
        with pytest.raises(FastForwardError, match=f"{field_name} must be >= 0, got {bad}"):
            make_policy(name, bad)
    assert POLICIES[name](math.inf) == make_policy(name, math.inf)  # no bound at all: allowed


def test_a_policy_refuses_what_the_gamma_flag_refuses(capsys):
    """`SBDDecoder(policy=EntropyBounded(-1.0))` was once accepted from Python while `--gamma -1` was refused."""
    with pytest.raises(FastForwardError, match=re.escape("gamma must be >= 0, got -1.0")):
        SBDDecoder(policy=EntropyBounded(-1.0))
    with pytest.raises(FastForwardError, match=re.escape("factor must be >= 0, got -0.5")):
        Factor(-0.5)
    for policy in (ConfidenceBounded(0.1), Factor(1.0), Threshold(0.9)):
        assert SBDDecoder(policy=policy).policy is policy
    err = refused(capsys, ["generate", "--decoder", "sbd", "--policy", "factor", "--gamma", "-1", "hi"])
    assert "gamma must be >= 0, got -1.0 (--gamma)" in err


# ---- objectives ---------------------------------------------------------------------------------------------
def test_an_objective_refuses_a_bad_value_from_python_by_name_and_from_train(tmp_path, capsys):
    words = "ntp weight must be >= 0, got -1.0"
    with pytest.raises(FastForwardError, match=re.escape(words)):
        SBD(ntp_weight=-1.0)
    with pytest.raises(FastForwardError, match=re.escape(words)):
        make_objective("sbd", ntp_weight=-1.0)
    with pytest.raises(FastForwardError, match=re.escape(f"{words} (--ntp-weight)")):
        make_objective("setdlm", label=lambda knob: knob.flag, ntp_weight=-1.0)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b c"}\n')
    argv = ["train", "--objective", "sbd", "--data", str(data), "--out", str(tmp_path / "run")]
    assert f"{words} (--ntp-weight)" in refused(capsys, [*argv, "--ntp-weight", "-1"])
    assert "max group must be >= 1, got 0 (--max-group)" in refused(
        capsys, [*argv, "--objective", "multitf", "--max-group", "0"]
    )
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_bounded_objective_option_is_refused_by_the_class_and_offered_with_its_bound(name):
    cls = OBJECTIVES[name]
    for field_name, knob in options_of(cls).items():
        if knob.choices:
            with pytest.raises(FastForwardError, match=f"{knob.name.replace('_', ' ')}: unknown value 'bogus'"):
                cls(**{field_name: "bogus"})
        elif knob.bound is not None:
            bad = next(v for v in (-1, 0, 1.5) if not knob.bound.holds(v))
            with pytest.raises(FastForwardError, match=re.escape(f"must be {knob.bound.rule}, got {bad}")):
                cls(**{field_name: bad})
            flag_help = train_help()[knob.flag]  # `fastforward train --help`
            assert f"; must be {knob.bound.rule} (" in flag_help and name in flag_help.rsplit("(", 1)[1]


def train_help() -> dict[str, str]:
    """The help of each flag of `fastforward train`."""
    (train,) = (a.choices["train"] for a in build_parser("train")._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action.help for action in train._actions for flag in action.option_strings}


def test_objectives_sharing_an_option_must_declare_it_alike(scratch_registries):
    from fastforward.training.objectives import NTP, register

    @register("ntp-unbounded")
    @dataclass
    class Unbounded(NTP):
        ntp_weight: float = option(1.0, "weight of the NTP term")  # the others bound it: >= 0

    with pytest.raises(TypeError, match="declares option 'ntp_weight' unlike"):
        options()


# ---- tasks ----------------------------------------------------------------------------------------------------
def test_a_task_refuses_a_bad_value_from_python_by_name_and_from_every_command(tmp_path, capsys):
    words = "max ops must be in [1, 6], got 9"
    with pytest.raises(FastForwardError, match=re.escape(words)):
        ArithmeticTask(max_ops=9)
    with pytest.raises(FastForwardError, match=re.escape(f"{words} (task option max_ops)")):
        get_task("arithmetic", max_ops="9")
    with pytest.raises(FastForwardError, match=re.escape(f"{words} (task option max_ops)")):
        get_task("arithmetic", max_ops=9)
    (tmp_path / "config.json").write_text("{}")  # a model directory, never loaded: the task is made first
    model = ["--model", str(tmp_path), "--task", "arithmetic", "--task-option", "max_ops=9"]
    assert words in refused(capsys, ["eval", *model])
    assert words in refused(capsys, ["trajectories", *model, "--out", str(tmp_path / "t.jsonl")])
    assert words in refused(capsys, ["lm-eval-tasks", str(tmp_path / "tasks"), "--task-option", "max_ops=9"])
    path = tmp_path / "qa.jsonl"
    path.write_text('{"prompt": "p", "answer": "a"}\n')
    with pytest.raises(FastForwardError, match="match: unknown value 'fuzzy'; choose one of exact, contains, regex"):
        JsonlTask(str(path), match="fuzzy")


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_lists_its_declared_options_and_refuses_a_value_outside_their_bounds(name):
    cls, known = TASKS[name], task_options(TASKS[name])
    assert known == {field_name: knob.default for field_name, knob in options_of(cls).items()} and known
    for field_name, knob in options_of(cls).items():
        if knob.bound is not None:
            bad = next(v for v in (-1, 0, 1.5) if not knob.bound.holds(v))
            with pytest.raises(FastForwardError, match=re.escape(f"must be {knob.bound.rule}, got {bad}")):
                get_task(name, **{field_name: str(bad)})


# ---- recipes ----------------------------------------------------------------------------------------
def test_a_recipe_refuses_a_bad_value_from_python_and_its_flag(tmp_path, capsys):
    from fastforward.recipes.pipeline import RECIPES

    for name, recipe in RECIPES.items():
        knobs = options_of(recipe.options_class)
        assert knobs["sft_share"].bound is not None and knobs["lora_rank"].bound is AT_LEAST_ONE
        with pytest.raises(FastForwardError, match=r"sft share must be in \(0, 1\), got 1.5"):
            recipe.options_class(sft_share=1.5)
        data = tmp_path / "data.jsonl"
        data.write_text('{"prompt": "1+1=", "completion": "2"}\n')
        argv = ["recipe", name, "--data", str(data), "--work", str(tmp_path / name), "--sft-share", "1.5"]
        assert "sft share must be in (0, 1), got 1.5" in refused(capsys, argv)
        assert not (tmp_path / name).exists()  # refused before any work
