"""`fastforward eval` and the evaluation API on a tiny random model saved to disk with a JSONL task."""

from __future__ import annotations

import json

import pytest

from fastforward.api import build_decoder
from fastforward.cli import main
from fastforward.decoding import metrics
from fastforward.errors import FastForwardError
from fastforward.evaluation.evaluate import compare, evaluate, parse_sweep, sweep
from fastforward.model import load_model
from fastforward.model.tiny import tiny_model
from fastforward.tasks import get_task

PROMPTS = ["Tom has 3 apples", "def add(a, b):", "The quick brown fox", "0123", "jumps over the lazy"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_model(seed=0, init_std=0.5)
    model.add_mask_token()
    path = tmp_path_factory.mktemp("models") / "tiny"
    model.save(path)
    return path


@pytest.fixture(scope="module")
def task_file(tmp_path_factory, model_dir):
    """A JSONL task whose first answers are what the model writes greedily (so accuracy is not 0)."""
    model = load_model(str(model_dir))
    gens = build_decoder("ar").generate(model, [model.encode_prompt(p) for p in PROMPTS], 12)
    path = tmp_path_factory.mktemp("tasks") / "echo.jsonl"
    with path.open("w") as f:
        for i, (prompt, gen) in enumerate(zip(PROMPTS, gens, strict=True)):
            answer = gen.text.strip() if i < 3 and gen.text.strip() else "no such answer"
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    return path


def check_consistent(result: dict) -> None:
    assert result["nfe"] > 0 and result["tokens"] > 0
    assert result["tpf"] * result["nfe"] == pytest.approx(result["tokens"], rel=1e-3)
    # seconds are reported to 4 decimals: allow that rounding
    assert result["tps"] * result["seconds"] == pytest.approx(result["tokens"], rel=1e-3, abs=result["tps"] * 1e-4)
    assert result["speedup"] == pytest.approx(result["tps"] / result["ar_tps"], rel=1e-3)
    assert 0 <= result["accuracy"] <= 100
    assert result["prefill_seconds"] <= result["seconds"]


def test_eval_cli_end_to_end(tmp_path, model_dir, task_file, capsys):
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(model_dir), "--task", str(task_file), "--decoder", "sbd", "--gamma", "0.5"]
    assert main([*argv, "--block-size", "4", "--max-new-tokens", "12", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "TPF" in printed and "speedup" in printed
    summary = json.loads((out / "results.json").read_text())
    ar, sbd = summary["results"]
    assert ar["label"] == "ar" and sbd["label"] == "sbd"
    for result in (ar, sbd):
        check_consistent(result)
        assert result["n"] == len(PROMPTS)
    assert ar["accuracy"] == pytest.approx(60.0)  # the first three answers are AR's own outputs
    assert sbd["ar_tps"] == ar["tps"]  # sbd's speedup is against the AR run beside it
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * len(PROMPTS)
    assert {r["label"] for r in records} == {"ar", "sbd"}
    # agreement with AR, computed here from both runs' token ids (sbd at γ 0.5 leaves AR's output here)
    ar_ids = {r["id"]: r["token_ids"] for r in records if r["label"] == "ar"}
    pairs = [(r["token_ids"], ar_ids[r["id"]]) for r in records if r["label"] == "sbd"]
    same = [ours == theirs for ours, theirs in pairs]
    assert len(pairs) == len(PROMPTS) and not all(same)
    assert sbd["agree_exact"] == pytest.approx(100 * sum(same) / len(same), abs=1e-3)
    matches = [sum(a == b for a, b in zip(ours, theirs, strict=False)) for ours, theirs in pairs]
    rates = [m / max(len(ours), len(theirs), 1) for m, (ours, theirs) in zip(matches, pairs, strict=True)]
    assert sbd["agree_tokens"] == pytest.approx(sum(rates) / len(rates), abs=1e-4)
    for label, result in (("ar", ar), ("sbd", sbd)):
        mine = [r for r in records if r["label"] == label]
        assert sum(r["nfe"] for r in mine) == result["nfe"]
        assert sum(r["tokens"] for r in mine) == result["tokens"]
        assert all(len(r["token_ids"]) == r["tokens"] for r in mine)
        assert 100 * sum(r["correct"] for r in mine) / len(mine) == pytest.approx(result["accuracy"])


def test_eval_cli_sweep_writes_plot_json_and_aup(tmp_path, model_dir, task_file):
    out = tmp_path / "sweep"
    argv = ["eval", "--model", str(model_dir), "--task", str(task_file), "--block-size", "4"]
    argv += ["--sweep", "gamma=0,0.5,4", "--max-new-tokens", "12", "--out", str(out), "--quiet", "--batch-size", "2"]
    assert main(argv) == 0
    assert (out / "sweep.png").stat().st_size > 1000
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    curve = json.loads((out / "sweep.json").read_text())
    assert curve["knob"] == "gamma" and curve["values"] == [0.0, 0.5, 4.0]
    points = [(p["tpf"], p["accuracy"]) for p in curve["points"]]
    assert curve["aup"] == pytest.approx(metrics.aup(points), rel=1e-3)
    for p in curve["points"]:
        check_consistent(p)
        assert p["batch_size"] == 2
    # a larger γ never reveals fewer tokens per forward on the same prompts
    assert points[0][0] <= points[-1][0] + 1e-9


def test_python_api_figures(model_dir, task_file):
    model = load_model(str(model_dir))
    task = get_task(str(task_file))
    result = evaluate(model, task, build_decoder("sbd", block_size=4, gamma=0.0), max_new_tokens=12, progress=False)
    assert result.label == "sbd" and result.n == len(PROMPTS)
    assert result.tpf * result.nfe == pytest.approx(result.tokens)
    assert result.speedup == pytest.approx(result.tps / result.ar_tps)
    assert len(result.records) == len(PROMPTS)
    ar = evaluate(model, task, "ar", max_new_tokens=12, progress=False)
    prompts = [model.encode_prompt(e.prompt) for e in task.examples()]
    alone = [g.token_ids for g in build_decoder("ar").generate(model, prompts, 12)]
    assert ar.label == "ar" and [r["token_ids"] for r in ar.records] == alone
    curve = sweep(model, task, "sbd", "gamma", [0.0, 1.0], knobs={"block_size": 4}, max_new_tokens=12, progress=False)
    assert [p.label for p in curve.points] == ["gamma=0.0", "gamma=1.0"]
    assert curve.aup == pytest.approx(metrics.aup(curve.curve))
    both = compare(model, task, {"a": build_decoder("sbd", block_size=4)}, max_new_tokens=12, progress=False)
    assert set(both) == {"ar", "a"}


def test_a_batched_pass_for_quality_and_a_timed_pass_at_batch_1(model_dir, task_file, tmp_path, monkeypatch):
    """compare(batch_size=4, timed=2) at the demo's precision (float32): every example's tokens, accuracy,
    NFE and TPF at batch 4 equal batch 1's for AR and a lossless decoder; TPS and speedup come from the first
    two examples again, one at a time, AR first."""
    from fastforward.evaluation import evaluate as module

    model = load_model(str(model_dir))
    task = get_task(str(task_file))
    decoders = {"jacobi": build_decoder("jacobi", block_size=4)}
    alone = compare(model, task, decoders, max_new_tokens=12, progress=False)
    calls, timed_generate = [], module._timed_generate
    monkeypatch.setattr(
        module, "_timed_generate", lambda d, m, p, n: calls.append((d.name, p)) or timed_generate(d, m, p, n)
    )
    both = compare(model, task, decoders, max_new_tokens=12, batch_size=4, timed=2, progress=False)
    prompts = [model.encode_prompt(e.prompt) for e in task.examples()]
    warm, batched, clocked = calls[:2], calls[2:6], calls[6:]
    assert [(name, len(p)) for name, p in warm + batched] == [
        ("ar", 1),
        ("jacobi", 1),
        ("ar", 4),
        ("jacobi", 4),
        ("ar", 1),
        ("jacobi", 1),
    ]
    assert clocked == [("ar", [prompts[0]]), ("jacobi", [prompts[0]]), ("ar", [prompts[1]]), ("jacobi", [prompts[1]])]
    for label in ("ar", "jacobi"):
        one, four = alone[label], both[label]
        assert [r["token_ids"] for r in four.records] == [r["token_ids"] for r in one.records]
        assert (four.accuracy, four.nfe, four.tokens, four.batch_size) == (one.accuracy, one.nfe, one.tokens, 4)
        timing = four.timing
        assert (timing.n, timing.batch_size, timing.same_tokens) == (2, 1, 2)
        assert (timing.tokens, timing.nfe) == tuple(sum(r[k] for r in one.records[:2]) for k in ("tokens", "nfe"))
        assert four.tps == timing.tokens / timing.seconds and one.timing is None
    assert both["jacobi"].speedup == both["jacobi"].timing.tps / both["ar"].timing.tps
    assert both["jacobi"].agree_exact == 100.0

    out = tmp_path / "eval"
    argv = ["eval", "--model", str(model_dir), "--task", str(task_file), "--decoder", "jacobi", "--block-size", "4"]
    assert (
        main([*argv, "--max-new-tokens", "12", "--batch-size", "4", "--timed", "2", "--out", str(out), "--quiet"]) == 0
    )
    summary = json.loads((out / "results.json").read_text())["results"]
    assert [(r["batch_size"], r["n"], r["timed"]["n"], r["timed"]["same_tokens"]) for r in summary] == [
        (4, 5, 2, 2)
    ] * 2
    assert all(r["tps"] == r["timed"]["tps"] for r in summary)
    with pytest.raises(FastForwardError, match="timed"):
        compare(model, task, {}, timed=0, progress=False)


def test_parse_sweep_and_errors():
    assert parse_sweep("gamma=0,0.1,1") == ("gamma", [0.0, 0.1, 1.0])
    assert parse_sweep("block-size=4,8") == ("block_size", [4, 8])
    assert parse_sweep("policy=entropy,factor") == ("policy", ["entropy", "factor"])
    for bad in ("gamma", "gamma=", "nope=1,2", "block_size=1.5"):
        with pytest.raises(FastForwardError):
            parse_sweep(bad)


def test_eval_cli_reports_bad_input(model_dir, capsys):
    assert main(["eval", "--model", str(model_dir), "--task", "nope"]) == 2
    assert "unknown task" in capsys.readouterr().err
