"""The demo pipeline end to end on the 'smoke' budget (a few training steps, a few problems)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest

from fastforward.cli import build_parser, main
from fastforward.cli.train import train_config
from fastforward.decoding.metrics import aup
from fastforward.decoding.model_defaults import DecodingDefaults
from fastforward.demo import real_model, showcase, zoo
from fastforward.demo.pipeline import PRESETS, run_demo
from fastforward.errors import FastForwardError
from fastforward.model import SHIPPED_CHECKPOINTS, load_model


def test_demo_trains_evaluates_and_reuses(tmp_path):
    out, lines = tmp_path / "demo", []
    config = PRESETS["smoke"]
    result = run_demo(out, config, json_path=tmp_path / "t.json", threads=1, progress=False, log=lines.append)
    for name in ("pretrain", "ntp", "sbd"):
        assert (out / name / "config.json").exists()
    assert {"train_pretrain", "train_ntp", "train_sbd", "evaluate"} <= set(result.seconds)
    assert [(r["model"], r["decoder"], r["gamma"]) for r in result.rows] == [
        ("NTP", "AR", None),
        ("SBD", "AR", None),
        ("SBD", "SBD", config.gamma_low),
        ("SBD", "SBD", config.gamma_high),
        ("SBD", "SBD-VERIFIED", None),
    ]
    for row in result.rows:
        for key in ("model", "decoder", "gamma", "accuracy", "nfe", "tpf", "tps", "speedup"):
            assert key in row
        assert row["tpf"] * row["nfe"] == pytest.approx(row["tokens"], rel=1e-2)
    assert result.rows[0]["speedup"] == pytest.approx(1.0) and result.rows[1]["speedup"] == pytest.approx(1.0)
    assert [p["gamma"] for p in result.sweep] == config.sweep_values()
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["rows"] == result.rows
    y_max = max(r["accuracy"] for r in [*result.rows, *result.sweep])
    curve = [(p["tpf"], p["accuracy"]) for p in result.sweep]
    assert written["aup"] == {"sbd": round(aup(curve, y_max), 2), "y_max": y_max}
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == config.eval_examples * (3 + len(config.sweep_values()))
    text = "\n".join(lines)
    assert "wall speedup" in text and "NFE speedup" in text

    # a second run reuses the models; changing an evaluation setting does not retrain
    weights = (out / "sbd" / "model.safetensors").stat().st_mtime_ns
    lines.clear()
    again = run_demo(out, replace(config, gamma_high=2.0), threads=1, progress=False, log=lines.append)
    assert not any(k.startswith("train_") for k in again.seconds)
    assert (out / "sbd" / "model.safetensors").stat().st_mtime_ns == weights
    assert sum("reusing" in line for line in lines) == 3
    assert again.rows[3]["gamma"] == 2.0

    # a training setting that changed, or --retrain, trains again
    lines.clear()
    changed = run_demo(out, replace(config, finetune_steps=2), threads=1, progress=False, log=lines.append)
    assert "train_sbd" in changed.seconds and any("other settings" in line for line in lines)


def test_demo_cli_smoke(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = [
        "demo",
        "--quick",
        "--preset",
        "smoke",
        "--out",
        str(out),
        "--threads",
        "1",
        "--quiet",
        "--json",
        str(tmp_path / "t.json"),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "accuracy %" in printed and "SBD" in printed
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 5 and rows[4]["decoder"] == "SBD-VERIFIED"
    assert main([*argv, "--retrain", "--n", "2"]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["rows"][0]["n"] == 2


def test_zoo_jacobi_forcing_stage_trains_one_round_into_its_folder(tmp_path, monkeypatch):
    config = PRESETS["smoke"]
    graded = zoo.task_prompts

    def every_answer_correct(*args, **kwargs):  # an untrained model answers none right; the stage keeps only those
        return dataclasses.replace(graded(*args, **kwargs), grade=lambda index, text: True)

    monkeypatch.setattr(zoo, "task_prompts", every_answer_correct)
    zoo.train_stage(zoo.Stage("ntp", None, "ntp", 2, 1e-3), tmp_path, config, log=lambda _: None)
    options = {"prompts": 3, "block_size": 4, "batch_size": 2}
    zoo.train_stage(zoo.Stage("jf", "ntp", "jacobi_forcing", 2, 1e-3, options), tmp_path, config, log=lambda _: None)
    trained = json.loads((tmp_path / "jf-rounds" / "round-1" / "train_config.json").read_text())
    # the settings of the command its provenance records (`fastforward jacobi-forcing ...`)
    argv = ["jacobi-forcing", "--model", "m", "--out", "o", "--task", "arithmetic", "--steps", "2", "--lr", "0.001"]
    argv += ["--batch-size", "2", "--seq-len", "320", "--warmup", "20", "--save-every", "1", "--keep-checkpoints", "1"]
    argv += ["--no-bf16"]  # the recipe trains without autocast on every machine, a GPU's included
    command = build_parser().parse_args([*argv, "--seed", str(config.seed)])
    assert dataclasses.asdict(train_config(command, eval_every=0)) == trained["train"]
    objective = {"noise_schedule": "random", "noise_window": 4, "noisy_context": "clean", "ar_weight": 1.0}
    objective |= {"states": "rollout", "block_size": 4}  # its own trajectories, collected at block size 4
    assert trained["objective"] == {"name": "jacobi_forcing", **objective}
    assert (tmp_path / "jf" / "config.json").exists() and not (tmp_path / "jf" / "checkpoints").exists()


def test_zoo_stages_provenance_packing_and_task_options(tmp_path, capsys):
    config = PRESETS["smoke"]
    stages = [zoo.Stage("pretrain", None, "ntp", 2, 1e-3), zoo.Stage("sbd", "pretrain", "sbd", 2, 1e-3)]
    for stage in stages:
        seconds = zoo.train_stage(stage, tmp_path, config, log=lambda _: None)
        zoo.write_provenance(tmp_path / stage.name, stage, seconds, "test")
    record = json.loads((tmp_path / "sbd" / "provenance.json").read_text())
    assert record["stage"]["objective"] == "sbd" and "mask_loss" in record["final_losses"]
    assert record["description"] == "the demo's small llama for arithmetic: sbd from its pretrain stage, 2 steps"
    # a stage's block options set the training blocks; the rest go to its objective
    post = zoo.Stage("multitf", "sbd", "multitf", 2, 1e-4, {"max_group": 2, "min_block": 4, "max_block": 4})
    zoo.train_stage(post, tmp_path, config, log=lambda _: None)
    steps = [json.loads(line) for line in (tmp_path / "multitf" / "metrics.jsonl").read_text().splitlines()]
    assert {r["block"] for r in steps if r.get("split") == "train"} == {4.0}
    trained = json.loads((tmp_path / "multitf" / "train_config.json").read_text())["objective"]
    assert (trained["max_group"], trained["min_block"], trained["max_block"]) == (2, 4, 4)
    shipped = zoo.pack(tmp_path / "sbd", tmp_path / "shipped" / "sbd")
    assert zoo.verify(shipped)["stored_as"] == "bfloat16"
    assert zoo.task_options(shipped, "arithmetic") == {"min_ops": 2, "max_ops": 3, "max_number": 20, "max_factor": 5}
    assert zoo.task_options(shipped, "pycode") == {}
    assert zoo.task_options(shipped, "arithmetic-number-infill") == zoo.task_options(shipped, "arithmetic")
    assert zoo.task_options(shipped, "arithmetics") == {}
    data = (shipped / "model.safetensors").read_bytes()
    (shipped / "model.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(FastForwardError, match="does not match its provenance"):
        zoo.verify(shipped)
    (shipped / "model.safetensors").write_bytes(data)
    capsys.readouterr()
    assert main(["eval", "--model", str(shipped), "--task", "arithmetic", "--n", "1", "--no-chat-template"]) == 0
    assert "trained for: {'min_ops': 2, 'max_ops': 3" in capsys.readouterr().out


def test_demo_aup_per_model_and_sweep_hand_computed():
    """One scale (y_max 80, the best row); a sweep's points make one curve, any other row its own."""
    rows = [
        {"model": "SBD", "decoder": "AR", "tpf": 1.0, "accuracy": 80.0},
        {"model": "SBD", "decoder": "sbd γ=0.1", "tpf": 2.0, "accuracy": 78.0},
        {"model": "SBD", "decoder": "sbd γ=0.35", "tpf": 4.0, "accuracy": 76.0},
        {"model": "MultiTF", "decoder": "mbd τ=0.9 (block 6 x3)", "tpf": 3.0, "accuracy": 70.0},
    ]
    got = {(a["model"], a["method"]): (a["points"], a["aup"]) for a in showcase.aup_rows(rows, showcase.Settings())}
    # AR: 1 * 80 * W(80) = 80. The sweep: 2 * 78 W(78) + (4 - 2) (78 W(78) + 76 W(76)) / 2 with
    # W(78) = exp(-0.075), W(76) = exp(-0.15): 144.728 + 137.778 = 282.506. mbd: 3 * 70 * exp(-0.375).
    assert got == {
        ("SBD", "AR"): (1, 80.0),
        ("SBD", "sbd, γ sweep (block 16)"): (2, 282.51),
        ("MultiTF", "mbd τ=0.9 (block 6 x3)"): (1, 144.33),
    }


@pytest.mark.skipif(not (SHIPPED_CHECKPOINTS / "sbd").is_dir(), reason="no shipped checkpoints in this tree")
def test_demo_evaluates_the_shipped_checkpoints(tmp_path, capsys):
    argv = ["demo", "--n", "3", "--threads", "1", "--quiet", "--out", str(tmp_path), "--json", str(tmp_path / "t.json"),
            "--real-n", "0", "--batch-size", "2", "--timed", "1"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert {r["model"] for r in rows} == {"NTP", "Jacobi Forcing", "SBD", "MultiTF", "SetDLM"}
    out = capsys.readouterr()
    assert "provenance" not in out.err
    # every problem in batches of 2; the first one again at batch 1, which gave the same tokens (float32)
    assert all((r["n"], r["batch_size"], r["timed_n"], r["timed_same_tokens"]) == (3, 2, 1, 1) for r in rows)
    assert "accuracy, NFE, TPF: 3 examples at batch 2; TPS and speedup: the first 1 again at batch 1" in out.out
    assert f"the same tokens at both batch sizes: {len(rows)} of {len(rows)} outputs" in out.out
    aups = json.loads((tmp_path / "t.json").read_text())["aup"]
    methods = {(a["model"], a["method"]) for a in aups}
    assert ("SBD", "AR") in methods and ("MultiTF", "mbd τ=0.9 (block 6 x3)") in methods
    assert ("SBD", "sbd, γ sweep (block 16)") in methods
    assert "AUP of the checkpoints (accuracy under parallelism" in out.out
    sweep = next(a for a in aups if a["method"].startswith("sbd, γ sweep"))
    assert sweep["points"] == 4


def test_the_real_model_rows_compare_each_model_with_its_own_ar_and_jacobi_is_lossless(tiny, tmp_path, monkeypatch):
    """The SmolLM2 rows' plumbing, on a tiny model in place of SmolLM2 and its adapter (int4, --exact)."""
    tiny.save(tmp_path / "m")
    loaded = []

    def load(name, **precision):
        loaded.append((name, precision))
        return load_model(str(tmp_path / "m"), **precision)

    monkeypatch.setattr(real_model, "load_model", load)
    monkeypatch.setattr(real_model, "task_options", lambda: {"max_ops": 2, "max_number": 10})
    own = {real_model.JF_PRESET: DecodingDefaults("jacobi", {"block_size": 4})}  # the base has no decoding.json
    monkeypatch.setattr(real_model, "model_decoding_defaults", own.get)
    settings = real_model.RealSettings(n=3, max_new_tokens=12, batch_size=3, timed=2)
    rows, results = real_model.evaluate_real_model(settings, False)
    assert loaded == [(real_model.JF_PRESET, real_model.SERVED), (real_model.BASE, real_model.SERVED)]
    jf, base = real_model.LABELS[real_model.JF_PRESET], real_model.LABELS[real_model.BASE]
    assert [(r["model"], r["decoder"]) for r in rows] == [
        (jf, "AR"), (jf, "jacobi --block-size 4"), (jf, "lookup"), (base, "AR"), (base, "lookup")
    ]  # fmt: skip
    assert all(r["n"] == 3 for r in rows) and {r.label for r in results} == {"ar", "jacobi --block-size 4", "lookup"}
    assert all(r["agree_exact"] == 100.0 for r in rows if r["decoder"] != "AR")  # lossless: AR's tokens
    assert all((r["batch_size"], r["timed_n"], r["timed_same_tokens"]) == (3, 2, 2) for r in rows)  # --exact


def test_the_demo_says_why_it_leaves_the_real_model_rows_out(monkeypatch):
    monkeypatch.setattr(real_model, "unavailable", lambda: "the base model's package is not installed")
    lines = []
    assert showcase.real_model_rows(real_model.RealSettings(n=1), False, lines.append) == ([], [])
    assert lines == ["the SmolLM2 rows are left out: the base model's package is not installed"]


@pytest.mark.parametrize(
    "command", ["generate", "eval", "train", "serve", "infill", "trajectories", "jacobi-forcing", "demo"]
)
def test_every_model_command_takes_threads(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--threads" in capsys.readouterr().out


def test_threads_flag_sets_torch_threads(tmp_path, tiny, capsys):
    import torch

    tiny.save(tmp_path / "m")
    before = torch.get_num_threads()
    try:
        argv = [
            "generate",
            "--model",
            str(tmp_path / "m"),
            "--threads",
            "2",  # tests run on one thread (conftest): 2 must come from the flag
            "--max-new-tokens",
            "2",
            "--dtype",
            "float32",
        ]
        assert torch.get_num_threads() == 1
        assert main([*argv, "hi"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
