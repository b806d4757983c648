"""Infilling tasks: examples that reassemble into the original text, grading, and `compare` on them."""

from __future__ import annotations

import pytest

from fastforward.api import build_decoder
from fastforward.evaluation.evaluate import compare, infill_rows
from fastforward.tasks import ArithmeticTask, Example, get_task

SMALL = dict(max_ops=3, max_number=20, max_factor=5)


def test_arithmetic_infill_hides_a_calculation_line_of_the_solution():
    plain = ArithmeticTask(**SMALL).examples("test", 30, seed=3)
    hidden = get_task("arithmetic-infill", **SMALL).examples("test", 30, seed=3)
    lines_hidden = set()
    for a, b in zip(plain, hidden, strict=True):
        assert b.prompt + b.reference + b.meta["suffix"] == a.prompt + a.completion
        assert not b.reference.startswith("####") and "=" in b.reference
        assert b.meta["suffix"].endswith(f"#### {a.reference}")
        lines_hidden.add(b.meta["hidden_line"])
    assert len(lines_hidden) > 1  # not always the same line
    assert [e.reference for e in get_task("arithmetic-infill", **SMALL).examples("test", 30, seed=3)] == [
        e.reference for e in hidden
    ]


def test_arithmetic_number_infill_hides_a_number_that_only_the_suffix_gives_away():
    plain = ArithmeticTask(**SMALL).examples("test", 60, seed=3)
    hidden = get_task("arithmetic-number-infill", **SMALL).examples("test", 60, seed=3)
    for a, b in zip(plain, hidden, strict=True):
        assert b.prompt + b.reference + b.meta["suffix"] == a.prompt + a.completion
        number = b.reference.strip()
        assert number.isdigit() and b.reference in (f" {number}", number)  # " 3" or the 10 of "$10"
        assert len(b.prompt) < len(a.prompt)  # hidden in the problem statement, not its question
        solution = b.meta["suffix"][b.meta["suffix"].index("\n") + 1 :]
        assert number in solution.replace("=", " ").split()  # the worked solution writes it out
    assert len({len(e.prompt) for e in hidden}) > 10  # numbers at many places


def test_pycode_infill_reassembles_the_file():
    task = get_task("pycode-infill", suffix_lines=3)
    for e in task.examples("test", 5, seed=1):
        path = task.root / e.meta["file"]
        lines = path.read_text(encoding="utf-8").replace("\r\n", "\n").splitlines(keepends=True)
        cut = e.meta["line"] - 1
        assert e.prompt.endswith("\n") and lines[cut].rstrip("\n") == e.reference
        assert e.meta["suffix"] == "\n" + "".join(lines[cut + 1 : cut + 4]).rstrip("\n")


def test_grading_is_exact_match_with_rouge_l_as_the_score():
    task = get_task("arithmetic-infill")
    example = Example("x", "p", "Nora has 15 + 15 = 30 marbles.", meta={"suffix": "s"})
    assert task.grade(example, " Nora has 15 + 15 = 30 marbles.\n").correct
    partial = task.grade(example, "Nora has 15 + 15 = 31 marbles.")
    assert not partial.correct and 0.5 < partial.score < 1
    assert task.grade(example, "").score == 0.0
    with pytest.raises(Exception, match="suffix_lines"):
        get_task("pycode-infill", suffix_lines=0)


def test_compare_infills_with_setdlm_and_runs_the_others_from_the_prefix(tiny):
    task = get_task("arithmetic-infill", **SMALL)
    examples = task.examples("test", 3, seed=0)
    rows = infill_rows(tiny, examples)
    decoders = {"setdlm": build_decoder("setdlm", window=3), "sbd": build_decoder("sbd", block_size=4)}
    results = compare(tiny, task, decoders, examples, batch_size=2, progress=False, warmup=False)
    for label in ("ar", "sbd", "setdlm"):
        outputs = results[label].records
        assert all(len(r["token_ids"]) <= row.gap for r, row in zip(outputs, rows, strict=True)), label
    assert [len(r["token_ids"]) for r in results["setdlm"].records] == [
        row.gap if r["finish_reason"] != "stop" else len(r["token_ids"])
        for r, row in zip(results["setdlm"].records, rows, strict=True)
    ]
    assert 0 <= results["setdlm"].score <= 1
