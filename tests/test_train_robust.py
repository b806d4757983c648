"""Hardening of the trainer: damaged checkpoints, a locked run directory, model spellings, a reproducible mask token."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import Stop, crash_at
from transformers import LlamaConfig, LlamaForCausalLM

from fastforward.errors import FastForwardError
from fastforward.model import Model, load_model
from fastforward.model.tiny import fit_tokenizer, tiny_model
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import NTP, SBD
from fastforward.training.run_dir import LOCK, checkpoint_problem, checkpoints, lock_run_dir
from fastforward.training.trainer import Callback, TrainConfig, train

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Tom has 3 apples and buys 5 more. 3 + 5 = 8\n",
    "The quick brown fox jumps over the lazy dog.\n",
]


def packed(model: Model, seq_len: int = 32, repeat: int = 8) -> PackedData:
    examples = [encode_record({"text": t}, model.tokenizer) for t in TEXTS * repeat]
    return PackedData(examples, seq_len, model.pad_token_id)


def config(**overrides) -> TrainConfig:
    base = dict(steps=8, seq_len=32, batch_size=2, grad_accum=2, lr=3e-3, warmup=2, save_every=2, eval_every=0)
    return TrainConfig(**{**base, **overrides})


def run(out: Path, callback=None, model: Model | None = None, **overrides) -> Model:
    model = model or tiny_model(TEXTS)
    train(model, SBD(max_block=6), packed(model), config(**overrides), out, callback=callback)
    return model


def noting(steps: list[int], then: Callback | None = None) -> Callback:
    """A callback that notes each step a run executes (and then calls `then`)."""

    def callback(step: int, record: dict) -> None:
        steps.append(step)
        if then is not None:
            then(step, record)

    return callback


def assert_same_weights(a: Model, b: Model) -> None:
    for (name, x), (_, y) in zip(a.hf.named_parameters(), b.hf.named_parameters(), strict=True):
        assert torch.equal(x, y), name


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Model:
    """An uninterrupted 8-step run: every resumed run below must end with exactly its weights."""
    return run(tmp_path_factory.mktemp("straight"))


# ---- damaged checkpoints ------------------------------------------------------------------------
def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated-weights": ("model.safetensors", truncate, "model.safetensors has"),
    "truncated-optimizer": ("optimizer.bin", truncate, "optimizer.bin has"),
    "empty-trainer-state": ("trainer_state.json", lambda p: p.write_text(""), "trainer_state.json has 0 bytes"),
    "same-size-garbage": ("optimizer.bin", flip_last_byte, "optimizer.bin does not match the sha256"),
    "no-manifest": ("manifest.json", Path.unlink, "no manifest.json"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, straight, capsys, damage):
    name, corrupt, reason = DAMAGE[damage]
    with pytest.raises(Stop):
        run(tmp_path, crash_at(4))
    corrupt(tmp_path / "checkpoints/step-000004" / name)
    steps: list[int] = []
    resumed = run(tmp_path, noting(steps))

    err = capsys.readouterr().err
    assert "skipping the damaged checkpoint" in err and "step-000004" in err and reason in err
    assert steps == [3, 4, 5, 6, 7, 8]  # from step-000002, the previous checkpoint, not from 0
    assert_same_weights(straight, resumed)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-000004", "step-000006"]
    assert all(checkpoint_problem(p) is None for p in checkpoints(tmp_path))


def test_no_valid_checkpoint_starts_over_and_keeps_the_damaged_until_replaced(tmp_path, straight, capsys):
    with pytest.raises(Stop):
        run(tmp_path, crash_at(4))
    for checkpoint in checkpoints(tmp_path):
        (checkpoint / "trainer_state.json").write_text("")
    steps: list[int] = []
    with pytest.raises(Stop):  # keep 1, checkpoints at 3: step-000002 is pruned only once step-000003 exists
        run(tmp_path, noting(steps, crash_at(3)), save_every=3, keep_checkpoints=1)
    assert "no checkpoint in" in capsys.readouterr().err
    assert steps == [1, 2, 3]
    assert [p.name for p in checkpoints(tmp_path)] == ["step-000003", "step-000004"]  # damaged 4: nothing newer yet
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # the old run's records are dropped

    steps.clear()
    resumed = run(tmp_path, noting(steps), save_every=3, keep_checkpoints=1)
    assert "step-000004" in capsys.readouterr().err
    assert steps == [4, 5, 6, 7, 8]  # from step-000003, the newest valid one
    assert_same_weights(straight, resumed)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-000006"]


# ---- the run directory lock ---------------------------------------------------------------------
HOLDER = """
import sys
from pathlib import Path
from fastforward.training.run_dir import lock_run_dir
with lock_run_dir(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_second_run_is_refused_while_the_first_holds_the_directory(tmp_path):
    out = tmp_path / "run"
    model = tiny_model(TEXTS)

    def overwrite() -> None:
        train(model, NTP(), packed(model), config(steps=2), out, overwrite=True)

    run(out, steps=3)  # a finished run with a checkpoint, which --overwrite would delete
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        message = re.escape(
            f"{out} is in use by another training run (pid {holder.pid}); wait for it or choose another --out"
        )
        with pytest.raises(FastForwardError, match=message):
            run(out, steps=3)
        with pytest.raises(FastForwardError, match=message):
            overwrite()
        assert (out / "config.json").exists() and checkpoints(out)  # the overwrite deleted nothing
    finally:
        holder.kill()  # the hardest way to exit: no cleanup code runs (a normal exit closes the file just the same)
        holder.wait(timeout=60)
    with lock_run_dir(out):
        assert (out / LOCK).read_text() == f"{os.getpid()}\n"
    overwrite()
    assert (out / LOCK).exists() and (out / "config.json").exists()


def test_lock_is_released_when_train_fails_and_not_put_into_foreign_directories(tmp_path):
    with pytest.raises(Stop):
        run(tmp_path / "run", crash_at(2))
    with lock_run_dir(tmp_path / "run"), pytest.raises(FastForwardError, match="in use by another training run"):
        run(tmp_path / "run")  # a second lock in the same process conflicts too: one run per directory
    run(tmp_path / "run")  # resumes: the failed attempt left the lock free
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FastForwardError, match="not a fastforward run directory"):
        run(tmp_path / "other")
    assert not (tmp_path / "other" / LOCK).exists()


# ---- the same model, spelled differently ---------------------------------------------------------
def test_resume_accepts_the_same_model_spelled_differently(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_model(TEXTS).save(tmp_path / "base")
    (tmp_path / "link").symlink_to(tmp_path / "base")
    with pytest.raises(Stop):
        run(tmp_path / "run", crash_at(2), model=load_model("base"))
    record = json.loads((tmp_path / "run/train_config.json").read_text())
    assert record["model"]["name"] == str(tmp_path / "base")
    record["model"]["name"] = "base"  # as recorded before names were resolved
    (tmp_path / "run/train_config.json").write_text(json.dumps(record))
    for spelling, at in (("./base", 4), (str(tmp_path / "base"), 6)):
        with pytest.raises(Stop):
            run(tmp_path / "run", crash_at(at), model=load_model(spelling))
    run(tmp_path / "run", model=load_model("link"))
    assert len((tmp_path / "run/metrics.jsonl").read_text().splitlines()) == 8
    tiny_model(TEXTS, seed=1).save(tmp_path / "other")
    with pytest.raises(Stop):
        run(tmp_path / "run2", crash_at(2), model=load_model("base"))
    with pytest.raises(FastForwardError, match="different settings"):
        run(tmp_path / "run2", model=load_model("other"))


# ---- the mask token -----------------------------------------------------------------------------
def untied_model() -> Model:
    tokenizer = fit_tokenizer(TEXTS, 300)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Model(LlamaForCausalLM(config).eval(), tokenizer, name="untied")


@pytest.mark.parametrize("make", [lambda: tiny_model(TEXTS), untied_model], ids=["tied", "untied"])
def test_mask_token_embedding_is_exactly_the_mean_of_the_others(make):
    model = make()
    inputs = model.hf.get_input_embeddings().weight.detach().clone()
    outputs = model.hf.get_output_embeddings().weight.detach().clone()
    mask = model.add_mask_token()
    assert mask == len(inputs) == model.hf.get_input_embeddings().num_embeddings - 1
    new_inputs, new_outputs = model.hf.get_input_embeddings().weight, model.hf.get_output_embeddings().weight
    assert torch.equal(new_inputs[:mask], inputs) and torch.equal(new_outputs[:mask], outputs)
    assert torch.equal(new_inputs[mask], inputs.mean(dim=0))
    assert torch.equal(new_outputs[mask], outputs.mean(dim=0))
    assert (new_outputs is new_inputs) == model.hf.config.tie_word_embeddings


ADD_MASK = """
import sys
import torch
from fastforward.model import load_model
model = load_model(sys.argv[1])
torch.manual_seed(1)  # a process whose random state differs from the test's
model.add_mask_token()
model.save(sys.argv[2])
"""


def test_adding_the_mask_token_is_the_same_in_every_process(tmp_path):
    untied_model().save(tmp_path / "base")
    child = subprocess.run(
        [sys.executable, "-c", ADD_MASK, str(tmp_path / "base"), str(tmp_path / "child")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert "multivariate normal" not in child.stderr  # transformers' notice about its random initialisation
    model = load_model(str(tmp_path / "base"))
    torch.manual_seed(2)
    model.add_mask_token()
    theirs = load_file(tmp_path / "child" / "model.safetensors")
    ours = dict(model.hf.named_parameters())
    assert theirs.keys() == ours.keys() and "lm_head.weight" in theirs
    for key, value in theirs.items():
        assert torch.equal(value, ours[key]), key
