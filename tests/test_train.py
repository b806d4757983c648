"""The trainer: loss falls, kill-and-resume is exact, checkpoints are atomic, the CLI works end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from fastforward.cli import main
from fastforward.errors import FastForwardError
from fastforward.model import Model, load_model
from fastforward.model.tiny import tiny_model
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import NTP, SBD, JacobiForcing, MultiTF, SetDLM
from fastforward.training.run_dir import checkpoints
from fastforward.training.trainer import TrainConfig, train
from fastforward.training.trajectories.dataset import TrajectoryBatch
from fastforward.training.trajectories.records import Block, Trajectory

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Tom has 3 apples and buys 5 more. 3 + 5 = 8\n",
    "The quick brown fox jumps over the lazy dog.\n",
]


def packed(model, seq_len=32, repeat=8) -> PackedData:
    examples = [encode_record({"text": t}, model.tokenizer) for t in TEXTS * repeat]
    return PackedData(examples, seq_len, model.pad_token_id)


def config(**overrides) -> TrainConfig:
    base = dict(steps=8, seq_len=32, batch_size=2, lr=3e-3, warmup=2, save_every=2, eval_every=0)
    return TrainConfig(**{**base, **overrides})


class Stop(Exception):
    pass


def crash_at(at: int):
    """A callback that kills training right after step `at` (and that step's checkpoint)."""

    def callback(step: int, record: dict) -> None:
        if step == at:
            raise Stop

    return callback


@pytest.mark.parametrize(
    "objective", [NTP(), SBD(min_block=2, max_block=8), MultiTF(min_block=2, max_block=8)], ids=lambda o: o.name
)
def test_loss_falls_on_a_tiny_task(tmp_path, objective):
    model = tiny_model(TEXTS)
    history = train(model, objective, packed(model), config(steps=40, save_every=0), tmp_path / "run")
    steps = [r for r in history if r["split"] == "train"]
    for term in ("ntp_loss",) if objective.name == "ntp" else ("ntp_loss", "mask_loss"):
        assert sum(r[term] for r in steps[-5:]) / 5 < 0.7 * steps[0][term], term


def test_a_step_counts_the_tokens_the_model_reads(tmp_path):
    """A budget in tokens means equal compute across methods: SBD and SetDLM read each row twice (the clean
    row and its masked copy), so a step of theirs counts twice NTP's tokens on the same rows."""
    counted = {}
    for objective in (NTP(), SBD(min_block=2, max_block=4), SetDLM()):
        model = tiny_model(TEXTS)
        history = train(model, objective, packed(model), config(steps=1, save_every=0), tmp_path / objective.name)
        counted[objective.name] = history[0]["tokens"]
    assert counted["sbd"] == counted["setdlm"] == 2 * counted["ntp"] == 2 * 2 * 32


def test_one_process_trains_twice_at_two_precisions(tmp_path):
    """accelerate keeps one state per process; a second `train` at another mixed precision (the CLI's
    bf16 default on a GPU after a library call's "no") gets its own instead of an error."""
    for precision in ("no", "bf16"):
        model = tiny_model(TEXTS)
        history = train(model, NTP(), packed(model), config(steps=1, mixed_precision=precision), tmp_path / precision)
        assert history[-1]["step"] == 1


def test_kill_and_resume_is_bit_identical(tmp_path, capsys):
    def run(out, callback=None) -> tuple[Model, list[int]]:
        """The trained model and the steps this call ran."""
        model = tiny_model(TEXTS)
        history = train(model, SBD(max_block=6), packed(model), config(grad_accum=2), out, callback=callback)
        return model, [r["step"] for r in history if r["split"] == "train"]

    straight, _ = run(tmp_path / "a")

    with pytest.raises(Stop):
        run(tmp_path / "b", crash_at(4))
    assert [p.name for p in checkpoints(tmp_path / "b")] == ["step-000002", "step-000004"]
    capsys.readouterr()
    resumed, steps = run(tmp_path / "b")
    assert steps == [5, 6, 7, 8]  # resumed after step 4, not started over
    assert f"resuming {tmp_path / 'b'} from step 4" in capsys.readouterr().out

    for (name, a), (_, b) in zip(straight.hf.named_parameters(), resumed.hf.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    optimizer = [torch.load(tmp_path / r / "checkpoints/step-000006/optimizer.bin") for r in "ab"]
    for a, b in zip(optimizer[0]["state"].values(), optimizer[1]["state"].values(), strict=True):
        assert a["step"] == b["step"] == 6
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    metrics = [(tmp_path / r / "metrics.jsonl").read_text().splitlines() for r in "ab"]
    strip = [[{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"} for x in m] for m in metrics]
    assert strip[0] == strip[1] and len(strip[0]) == 8


def test_resume_refuses_changed_settings_and_finished_runs(tmp_path):
    model = tiny_model(TEXTS)
    data = packed(model)
    with pytest.raises(Stop):
        train(model, NTP(), data, config(), tmp_path, callback=crash_at(2))
    with pytest.raises(FastForwardError, match=r"different settings \(train.lr: 0.003 → 0.001\)"):
        train(tiny_model(TEXTS), NTP(), data, config(lr=1e-3), tmp_path)
    train(tiny_model(TEXTS), NTP(), data, config(lr=1e-3, steps=3), tmp_path, overwrite=True)
    with pytest.raises(FastForwardError, match="finished run"):
        train(tiny_model(TEXTS), NTP(), data, config(lr=1e-3, steps=3), tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FastForwardError, match="not a fastforward run directory"):
        train(tiny_model(TEXTS), NTP(), data, config(), tmp_path / "other", overwrite=True)


def test_failed_checkpoint_leaves_nothing_visible(tmp_path, monkeypatch):
    def broken(self, output_dir, **kwargs):
        Path(output_dir).mkdir()
        (Path(output_dir) / "model.safetensors").write_bytes(b"half a fi")
        raise OSError("disk full")

    monkeypatch.setattr(Accelerator, "save_state", broken)
    model = tiny_model(TEXTS)
    with pytest.raises(OSError, match="disk full"):
        train(model, NTP(), packed(model), config(), tmp_path)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_final_model_reloads_with_its_mask_token_and_eval_is_logged(tmp_path):
    model = tiny_model(TEXTS)
    data = packed(model)
    train(model, SBD(max_block=4), data, config(steps=4, eval_every=2), tmp_path, eval_data=data)
    loaded = load_model(str(tmp_path))
    assert loaded.mask_token_id == model.mask_token_id is not None
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["model.embed_tokens.weight"], model.hf.get_input_embeddings().weight.cpu())
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_mask_loss"] > 0 for r in evals)


def test_cli_trains_a_saved_model_end_to_end(tmp_path, capsys):
    tiny_model(TEXTS).save(tmp_path / "base")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": t[:10], "completion": t[10:]}) + "\n" for t in TEXTS * 4))
    args = ["train", "--model", str(tmp_path / "base"), "--data", str(data), "--out", str(tmp_path / "run")]
    args += ["--steps", "2", "--seq-len", "32", "--batch-size", "2", "--eval-fraction", "0.25"]
    assert main(args) == 0
    assert "saved the model" in capsys.readouterr().out
    assert load_model(str(tmp_path / "run")).mask_token_id is not None


def test_cli_reports_user_mistakes_with_exit_code_2(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi"}\n')
    assert main(["train", "--model", str(tmp_path / "missing"), "--data", str(data), "--out", str(tmp_path)]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["train", "--data", str(data), "--out", str(tmp_path), "--steps", "0"]) == 2
    assert "steps must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "objective",
    [NTP(), SBD(min_block=2, max_block=8), MultiTF(min_block=2, max_block=8), SetDLM(), JacobiForcing()],
    ids=lambda o: o.name,
)
def test_bf16_autocast_loss_agrees_with_float32(objective):
    """The CLI trains under bf16 autocast where the hardware has bfloat16 arithmetic (`--bf16`'s default):
    the loss it optimises is float32's within 2 % on the same batch and draws."""
    model = tiny_model(TEXTS, seed=0, init_std=0.3)
    objective.setup(model)
    if objective.name == "jacobi_forcing":
        g = torch.Generator().manual_seed(0)
        fixed = [torch.randint(0, 200, (4,), generator=g).tolist() for _ in range(3)]
        states = [[torch.randint(0, 200, (4,), generator=g).tolist()] for _ in fixed]
        blocks = [Block(s, f) for s, f in zip(states, fixed, strict=True)]
        batch = TrajectoryBatch([Trajectory([5, 9, 14], blocks, 4, 0), Trajectory([7, 3], blocks[:2], 4, 1)])
    else:
        batch = packed(model).batch(0, 4, seed=0)
    losses = []
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses.append(objective.loss(model, batch, torch.Generator().manual_seed(3))[0].item())
    assert losses[0] > 0 and abs(losses[1] - losses[0]) <= 0.02 * losses[0], losses
