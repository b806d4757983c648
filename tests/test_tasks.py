import hashlib
import json
import operator
import re
from pathlib import Path

import pytest

from fastforward.errors import FastForwardError
from fastforward.tasks import ArithmeticTask, Example, JsonlTask, PyCodeTask, get_task, parse_options
from fastforward.tasks.arithmetic import parse_answer
from fastforward.tasks.arithmetic_stories import THEMES
from fastforward.tasks.humaneval import HumanEvalTask, build_program, extract_code

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


# ---- registry ---------------------------------------------------------------------------------------
def test_get_task_by_name_and_options():
    task = get_task("arithmetic", max_ops="3", max_number="50", strict="false")
    assert isinstance(task, ArithmeticTask)
    assert (task.max_ops, task.max_number, task.strict) == (3, 50, False)
    assert isinstance(get_task("pycode"), PyCodeTask)


def test_get_task_errors():
    with pytest.raises(FastForwardError, match="arithmetic, pycode, humaneval"):
        get_task("gsm8k")
    with pytest.raises(FastForwardError, match="no option.*max_opps.*max_ops=4"):
        get_task("arithmetic", max_opps=3)
    with pytest.raises(FastForwardError, match="task option max_ops takes int values, got 'three'"):
        get_task("arithmetic", max_ops="three")
    with pytest.raises(FastForwardError, match="name=value"):
        parse_options(["max_ops"])
    assert parse_options(["max_ops=3", "match = regex"]) == {"max_ops": "3", "match": "regex"}
    with pytest.raises(FastForwardError, match="no split 'dev'"):
        get_task("arithmetic").examples("dev", 1)


# ---- arithmetic -------------------------------------------------------------------------------------
def _evaluate_steps(solution: str) -> int:
    """Recompute a worked solution independently: every `a op b = c` must hold, and the final
    `#### n` must be the result of the last step."""
    lines = solution.split("\n")
    assert lines[-1].startswith("#### ")
    last = None
    for line in lines[:-1]:
        found = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", line)
        assert len(found) == 1, line
        a, op, b, c = found[0]
        a, b, c = int(a), int(b), int(c)
        if op == "/":
            assert a % b == 0 and a // b == c, line
        else:
            assert OPS[op](a, b) == c, line
        assert c > 0, line
        last = c
    assert int(lines[-1][5:]) == last
    return last


def test_arithmetic_solutions_are_right():
    task = ArithmeticTask()
    examples = task.examples("test", 400, seed=3)
    for ex in examples:
        assert _evaluate_steps(ex.completion) == int(ex.reference)
        assert 2 <= ex.completion.count("\n") <= 4  # one line per operation, then ####
        assert ex.prompt.endswith("?\n")
    # varied stories, not one template
    assert len({ex.prompt.split()[0] for ex in examples}) > 5


def test_arithmetic_deterministic_and_disjoint():
    task = ArithmeticTask()
    a = task.examples("test", 50, seed=0)
    assert a == task.examples("test", 50, seed=0)
    assert [e.prompt for e in a] != [e.prompt for e in task.examples("test", 50, seed=1)]
    test_prompts = {e.prompt for e in task.examples("test", 300, seed=0)}
    train_prompts = {e.prompt for e in task.examples("train", 2000, seed=0)}
    assert len(test_prompts) == 300 and len(train_prompts) == 2000
    assert not test_prompts & train_prompts
    records = task.training_records(5, seed=0)
    assert all(set(r) == {"prompt", "completion"} and r["prompt"] in train_prompts for r in records)


def test_arithmetic_knobs():
    task = ArithmeticTask(min_ops=2, max_ops=2, max_number=20, max_factor=4, themes="shopping,garden")
    for ex in task.examples("train", 100):
        assert ex.completion.count("\n") == 2
        _evaluate_steps(ex.completion)
        numbers = [int(x) for x in re.findall(r"\d+", ex.prompt)]
        assert max(numbers) <= 20
    with pytest.raises(FastForwardError, match="theme"):
        ArithmeticTask(themes=["space"])
    with pytest.raises(FastForwardError, match="min_ops"):
        ArithmeticTask(min_ops=3, max_ops=2)
    assert set(THEMES) >= {"shopping", "travel", "savings", "recipe"}


def test_varied_phrasing_tells_the_same_arithmetic_many_ways():
    """phrasing=varied: everyday stories and reworded ones, each solution still right; the default's problems
    are those of before the knob (a preset's data stays reproducible)."""
    knobs = {"min_ops": 2, "max_ops": 3, "max_number": 20, "max_factor": 5}
    plain, varied = ArithmeticTask(**knobs), ArithmeticTask(**knobs, phrasing="varied")
    examples = varied.examples("train", 400, seed=0)
    for ex in examples:
        assert _evaluate_steps(ex.completion) == int(ex.reference) and ex.prompt.endswith("?\n")
    prompts = [ex.prompt for ex in examples]
    assert sum("dollars" in p for p in prompts) > 10 and sum(" years old." in p for p in prompts) > 10  # reworded
    assert sum(" in each " in p or " of " in p for p in prompts) > 50  # groups said several ways
    same = set(prompts) & {ex.prompt for ex in plain.examples("train", 400, seed=0)}
    assert len(same) < 10  # a template story left unreworded may meet its twin; most differ
    kept = "".join(e.prompt + e.completion for e in plain.examples("train", 200, seed=0))  # as before the knob
    assert hashlib.sha256(kept.encode()).hexdigest().startswith("aca83b124e81b6fe")
    assert varied.describe()["phrasing"] == "varied" and "phrasing" not in plain.describe()
    with pytest.raises(FastForwardError, match="phrasing"):
        ArithmeticTask(phrasing="poetic")


def test_arithmetic_grader():
    task = ArithmeticTask()
    ex = Example("x", "q\n", "1026", "…")
    assert task.grade(ex, "She has 444 + 582 = 1026 dollars.\n#### 1026").correct
    assert task.grade(ex, "#### 1,026").correct
    assert task.grade(ex, "#### $1026.0").correct
    assert task.grade(ex, "#### 1026\n#### 7").correct  # the first #### line is the answer
    wrong = task.grade(ex, "#### 1025")
    assert not wrong.correct and wrong.score == 0.0 and "1025" in wrong.detail
    malformed = task.grade(ex, "The answer is 1026.")  # strict: no #### line
    assert not malformed.correct and "malformed" in malformed.detail
    assert not task.grade(ex, "").correct
    lenient = ArithmeticTask(strict=False)
    assert lenient.grade(ex, "so the answer is 1026.").correct
    assert not lenient.grade(ex, "no idea").correct
    assert parse_answer("#### -3") == -3


# ---- pycode -----------------------------------------------------------------------------------------
def test_pycode_examples_match_the_source_and_are_disjoint():
    task = PyCodeTask(lines=2, context_lines=10, max_prompt_chars=400)
    assert not set(task.files["train"]) & set(task.files["test"])
    test = task.examples("test", 20, seed=0)
    assert test == task.examples("test", 20, seed=0)
    assert [e.id for e in test] != [e.id for e in task.examples("test", 20, seed=1)]
    for ex in test:
        assert ex.meta["file"] in task.files["test"]
        lines = (task.root / ex.meta["file"]).read_text(encoding="utf-8").splitlines(keepends=True)
        cut = ex.meta["line"] - 1
        gap = "\n" * ex.meta["newlines"]  # the prompt stops before its line break
        assert "".join(lines[:cut]).endswith(ex.prompt + gap) and not ex.prompt.endswith("\n")
        assert len(ex.prompt) < 400 and ex.prompt.count("\n") < 10
        assert ex.completion == gap + "".join(lines[cut : cut + 16])
        assert ex.reference == "\n".join(line.rstrip() for line in lines[cut : cut + 2])
        assert ex.reference.split("\n")[0].strip()
    train = task.examples("train", 50, seed=0)
    assert all(e.meta["file"] in task.files["train"] for e in train)
    assert not {e.prompt for e in test} & {e.prompt for e in train}


def test_pycode_grader():
    task = PyCodeTask(lines=1)
    ex = Example("f.py:3", "def f(x):", "    return x + 1")
    assert task.grade(ex, "\n    return x + 1   \n    # more").correct
    assert not task.grade(ex, "\n  return x + 1").correct  # indentation counts
    wrong = task.grade(ex, "\n    return x - 1")
    assert not wrong.correct and "expected" in wrong.detail
    assert task.grade(ex, "\n").detail.startswith("malformed")
    assert task.grade(ex, "").detail.startswith("malformed")
    same_line = task.grade(ex, "    return x + 1")  # no newline: it continued the `def` line
    assert not same_line.correct and same_line.detail.startswith("no line break first")
    assert not task.grade(ex, "\n\n    return x + 1").correct  # a blank line first
    after_blank = Example("f.py:4", "x = 1", "y = 2", meta={"newlines": 2})
    assert task.grade(after_blank, "\n\ny = 2\n").correct
    assert not task.grade(after_blank, "\ny = 2").correct
    two = PyCodeTask(lines=2)
    ex2 = Example("f.py:3", "def f(x):", "    y = x\n    return y")
    assert two.grade(ex2, "\n    y = x\n    return y\n").correct
    half = two.grade(ex2, "\n    y = x\n    return x")
    assert not half.correct and half.score == 0.5
    assert two.grade(ex2, "\n    y = x").score == 0.5


def test_pycode_training_records(tmp_path: Path):
    for i in range(12):
        body = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(30))
        (tmp_path / f"m{i}.py").write_text(body)
    (tmp_path / "test_skip.py").write_text("x = 1\n")
    task = PyCodeTask(root=str(tmp_path), train_lines=3, test_fraction=0.3)
    assert "test_skip.py" not in task.files["train"] + task.files["test"]
    records = task.training_records(4, seed=0)
    assert len(records) == 4 and all(r["completion"].startswith("\n") for r in records)
    assert all(r["completion"].count("\n") <= 5 and not r["prompt"].endswith("\n") for r in records)
    texts = task.text_records(3, max_chars=200)
    assert len(texts) == 3 and all(len(r["text"]) <= 200 and r["text"].strip() for r in texts)


# ---- humaneval --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def humaneval():
    """Programs that end get all the time a loaded machine may need: no grade here depends on speed."""
    return HumanEvalTask(timeout=300.0)


def test_humaneval_runner(humaneval):
    problems = humaneval.examples("test", 3)
    assert len(humaneval.examples()) == 164 and problems[0].id == "HumanEval/0"
    grades = humaneval.grade_all(problems[:2], [p.completion for p in problems[:2]])
    assert all(g.correct and g.score == 1.0 for g in grades)
    wrong = humaneval.grade(problems[0], "    return not True\n")
    assert not wrong.correct and "AssertionError" in wrong.detail
    looping = HumanEvalTask(timeout=0.5).grade(problems[1], "    while True:\n        pass\n")  # it never ends
    assert not looping.correct and looping.detail == "timeout"
    with pytest.raises(FastForwardError, match="only a test split"):
        humaneval.examples("train", 1)


def test_humaneval_output_forms(humaneval):
    ex = humaneval.examples("test", 1)[0]
    entry = ex.meta["entry_point"]
    signature = next(line for line in ex.prompt.split("\n") if line.startswith(f"def {entry}"))
    full = (
        f"Sure:\n```python\nfrom typing import List\n\n{signature}\n{ex.completion}\nprint({entry}([], 1.0))\n```\nok"
    )
    assert humaneval.grade(ex, full).correct
    program, mode = build_program(ex.prompt, entry, full)
    assert mode == "function" and "print(" not in program
    body = ex.completion + "\n\ndef unrelated():\n    raise SystemExit(1)\nunrelated()\n"
    program, mode = build_program(ex.prompt, entry, body)
    assert mode == "body" and "unrelated" not in program
    assert humaneval.grade(ex, body).correct
    assert not humaneval.grade(ex, "").correct  # docstring-only function returns None
    assert extract_code("no fence") == "no fence"
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"


# ---- jsonl ------------------------------------------------------------------------------------------
def _write(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_task(tmp_path: Path):
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "capital of France?", "answer": 42, "id": "q2"}]
    path = _write(tmp_path / "qa.jsonl", [json.dumps(r) for r in rows])
    task = get_task(path)
    assert isinstance(task, JsonlTask) and task.name == "qa"
    a, b = task.examples()
    assert (a.id, b.id, b.reference) == ("1", "q2", "42")
    assert task.grade(a, " 4\n").correct
    assert not task.grade(a, "4 apples").correct
    assert task.grade(a, "").detail.startswith("malformed")
    assert get_task(path, match="contains").grade(a, "it is 4 apples").correct
    regex = get_task(_write(tmp_path / "re.jsonl", [json.dumps({"prompt": "p", "answer": r"^4\b"})]), match="regex")
    (r,) = regex.examples()
    assert regex.grade(r, "4 apples").correct
    assert not regex.grade(r, "14").correct
    assert task.examples("test", 1) == [a]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:2: not valid JSON"),
        ('{"prompt": "p"}', r"bad\.jsonl:2: expected an object"),
        ('{"prompt": "", "answer": "a"}', r"bad\.jsonl:2: \"prompt\" must"),
        ('{"prompt": "p", "answer": [1]}', r"bad\.jsonl:2: \"answer\" must"),
        ('["p", "a"]', r"bad\.jsonl:2: expected an object"),
    ],
)
def test_jsonl_malformed(tmp_path: Path, line: str, message: str):
    path = _write(tmp_path / "bad.jsonl", ['{"prompt": "p", "answer": "a"}', line])
    with pytest.raises(FastForwardError, match=message):
        get_task(path)


def test_jsonl_bad_regex_and_missing_file(tmp_path: Path):
    path = _write(tmp_path / "r.jsonl", ['{"prompt": "p", "answer": "(unclosed"}'])
    with pytest.raises(FastForwardError, match=r"r\.jsonl:1: .*regular expression"):
        get_task(path, match="regex")
    with pytest.raises(FastForwardError, match="match"):
        get_task(path, match="fuzzy")
    with pytest.raises(FastForwardError, match="does not exist"):
        get_task(str(tmp_path / "missing.jsonl"))


def test_a_test_problem_apart_from_training_differs_in_more_than_names_and_items():
    from fastforward.tasks.arithmetic import apart_from, masked

    assert masked("Mia buys 3 notebooks. She pays $6.") == masked("Tom buys 3 pens. He pays $6.")
    assert masked("Mia buys 3 notebooks.") != masked("Mia buys 4 notebooks.")
    task = get_task("arithmetic", min_ops=2, max_ops=3, max_number=20, max_factor=5)
    train, test = task.examples("train", n=3000, seed=0), task.examples("test", n=300, seed=1)
    kept = apart_from(test, train)
    assert len(kept) == 235 and all(e in test for e in kept)  # the figure its docstring gives
    prompts, solutions = {masked(e.prompt) for e in train}, {e.completion for e in train}
    assert not any(masked(e.prompt) in prompts or e.completion in solutions for e in kept)
