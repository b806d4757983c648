"""LoRA adapters: trained by `train --lora-rank`, saved as PEFT directories, merged at load, errors in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fastforward.api import build_decoder
from fastforward.cli import main
from fastforward.cpu import native
from fastforward.cpu.fusion import FusedMember
from fastforward.cpu.low_rank import LowRankLinear, W4A8LowRankLinear
from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model, load_model, visibility
from fastforward.model.adapters import ADAPTER_CONFIG, PROVENANCE
from fastforward.model.flatten import flatten
from fastforward.model.precision import Precision
from fastforward.model.tiny import tiny_model
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import NTP, SBD
from fastforward.training.trainer import TrainConfig, train

TEXTS = ["def add(a, b):\n    return a + b\n", "Tom has 3 apples and buys 5 more. 3 + 5 = 8\n"]


def logits(model, ids=(5, 17, 42, 9, 3)) -> torch.Tensor:
    n = len(ids)
    layout = Layout(torch.tensor([ids]), torch.arange(n)[None], visibility.causal(n)[None], read=torch.arange(n))
    with torch.inference_mode():
        return model.run(layout, None)


@pytest.fixture
def base(tmp_path):
    tiny_model(TEXTS, seed=1, init_std=0.3).save(tmp_path / "base")
    return tmp_path / "base"


def peft_adapter(base, out, target_modules=("q_proj", "v_proj"), seed=0):
    """An adapter made by peft itself, with non-zero B (a fresh LoRA is the identity)."""
    torch.manual_seed(seed)
    model = get_peft_model(load_model(str(base)).hf, LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    return model


def test_a_peft_adapter_loads_and_its_logits_equal_the_merged_model(base, tmp_path):
    wrapped = peft_adapter(base, tmp_path / "adapter")
    with torch.inference_mode():
        ids = torch.tensor([[5, 17, 42, 9, 3]])
        unmerged = wrapped(input_ids=ids).logits.float()
    merged = load_model(str(base), adapter=str(tmp_path / "adapter"))
    plain = load_model(str(base))
    torch.testing.assert_close(logits(merged)[0], unmerged[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(plain), logits(merged), atol=1e-3)  # the adapter changed something
    # peft recorded the base's path, so the adapter directory alone works as --model
    torch.testing.assert_close(logits(load_model(str(tmp_path / "adapter"))), logits(merged))


def test_bad_adapters_get_one_line_errors(base, tmp_path):
    with pytest.raises(FastForwardError, match="does not exist"):
        load_model(str(base), adapter=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FastForwardError, match="not a PEFT adapter directory"):
        load_model(str(base), adapter=str(tmp_path / "empty"))
    peft_adapter(base, tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(FastForwardError, match="has no weights"):
        load_model(str(base), adapter=str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "SomeOrg/not-here"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FastForwardError, match="names its base 'SomeOrg/not-here'.*--model BASE --adapter"):
        load_model(str(tmp_path / "adapter"))
    # an adapter for another base: a model with another hidden size
    tiny_model(TEXTS, hidden_size=32, seed=2).save(tmp_path / "other")
    peft_adapter(tmp_path / "other", tmp_path / "foreign")
    with pytest.raises(FastForwardError, match="does not fit this base model") as error:
        load_model(str(base), adapter=str(tmp_path / "foreign"))
    assert "\n" not in str(error.value)


def test_lora_training_saves_an_adapter_that_reloads_to_the_trained_weights(base, tmp_path):
    model = load_model(str(base))
    data = PackedData([encode_record({"text": t}, model.tokenizer) for t in TEXTS * 8], 32, model.pad_token_id)
    config = TrainConfig(steps=6, seq_len=32, batch_size=2, lr=1e-2, warmup=1, save_every=0, eval_every=0, lora_rank=4)
    history = train(model, SBD(max_block=4), data, config, tmp_path / "run")
    run = tmp_path / "run"
    assert (run / ADAPTER_CONFIG).is_file() and not (run / "config.json").exists()
    provenance = json.loads((run / PROVENANCE).read_text())
    assert provenance["objective"]["name"] == "sbd" and provenance["train"]["lora_rank"] == 4
    assert history[-1]["step"] == 6
    reloaded = load_model(str(run))  # the adapter names its base
    assert reloaded.mask_token_id == model.mask_token_id is not None
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=1e-5, atol=1e-5)
    untrained = logits(load_model(str(base)))
    assert not torch.allclose(logits(reloaded)[..., : untrained.shape[-1]], untrained, atol=1e-3)
    again = load_model(str(base))
    with pytest.raises(FastForwardError, match="finished run"):
        train(again, NTP(), data, config, run)
    assert not hasattr(again.hf, "peft_config")  # a refused run leaves the caller's model as it was
    torch.testing.assert_close(logits(again), untrained)


def test_lora_from_continues_a_finished_adapter_as_one_adapter_over_the_same_base(base, tmp_path):
    def run(out, steps, lr, **options) -> Model:
        model = load_model(str(base))
        data = PackedData([encode_record({"text": t}, model.tokenizer) for t in TEXTS * 8], 32, model.pad_token_id)
        config = TrainConfig(**{"steps": steps, "seq_len": 32, "batch_size": 2, "lr": lr, "warmup": 0,
                                "save_every": 0, "eval_every": 0, "lora_rank": 4, **options})  # fmt: skip
        train(model, NTP(), data, config, out)
        return model

    first = logits(run(tmp_path / "first", 4, 1e-2))
    assert not torch.allclose(first, logits(load_model(str(base))), atol=1e-3)
    # a learning rate too small to move anything: the continued adapter starts where the first one ended
    continued = run(tmp_path / "more", 2, 1e-12, lora_from=str(tmp_path / "first"))
    torch.testing.assert_close(logits(continued), first, rtol=1e-5, atol=1e-5)
    reloaded = load_model(str(tmp_path / "more"))
    provenance = json.loads((tmp_path / "more" / PROVENANCE).read_text())
    assert reloaded.adapter is None and provenance["base"] == str(base)  # a path loading follows
    assert provenance["train"]["lora_from"] == "first (a training folder)"  # history: no path
    torch.testing.assert_close(logits(reloaded), first, rtol=1e-5, atol=1e-5)
    with pytest.raises(FastForwardError, match="rank 4, not the run's LoRA rank 2"):
        run(tmp_path / "bad", 1, 1e-2, lora_from=str(tmp_path / "first"), lora_rank=2)
    with pytest.raises(FastForwardError, match="give its lora_rank"):
        TrainConfig(lora_from=str(tmp_path / "first")).validate()


def test_lora_on_the_top_layers_trains_those_alone_and_ships_as_them(base, tmp_path):
    """`lora_layers`: LoRA layers in the top N decoder layers only, nothing below them reached by the backward
    pass; the adapter loads and flattens as exactly those modules."""
    model = load_model(str(base))
    data = PackedData([encode_record({"text": t}, model.tokenizer) for t in TEXTS * 8], 32, model.pad_token_id)
    config = TrainConfig(steps=3, seq_len=32, batch_size=2, lr=1e-2, warmup=0, save_every=0, eval_every=0,
                         lora_rank=4, lora_layers=1)  # fmt: skip
    seen: list[set[str]] = []
    hook = lambda step, record: seen.append({n for n, p in model.hf.named_parameters() if p.requires_grad})  # noqa: E731
    train(model, NTP(), data, config, tmp_path / "top", callback=hook)
    assert seen[0] and all(".layers.1." in name and "lora_" in name for name in seen[0])  # 2 layers: the top one
    trained = json.loads((tmp_path / "top" / ADAPTER_CONFIG).read_text())["target_modules"]
    assert trained and all(".layers.1." in name for name in trained)
    reloaded = load_model(str(tmp_path / "top"))
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(reloaded), logits(load_model(str(base))), atol=1e-3)
    flat = flatten([tmp_path / "top"], tmp_path / "flat", str(base), dtype=torch.float32)
    torch.testing.assert_close(logits(load_model(str(flat))), logits(model), rtol=1e-5, atol=1e-5)
    every = load_model(str(base))
    train(every, NTP(), data, replace(config, lora_layers=3), tmp_path / "all")  # more than it has: every layer
    adapted = json.loads((tmp_path / "all" / ADAPTER_CONFIG).read_text())["target_modules"]
    assert {name.split(".")[2] for name in adapted} == {"0", "1"}


class Stop(Exception):
    pass


def test_lora_changes_only_the_adapted_weights_and_resumes_exactly(base, tmp_path):
    def run(out, callback=None) -> tuple[Model, list[int]]:
        """The trained model and the steps this call ran."""
        model = load_model(str(base))
        data = PackedData([encode_record({"text": t}, model.tokenizer) for t in TEXTS * 8], 32, model.pad_token_id)
        config = TrainConfig(steps=4, seq_len=32, batch_size=2, lr=1e-2, warmup=1, save_every=2, lora_rank=2)
        history = train(model, NTP(), data, config, out, callback=callback)
        return model, [r["step"] for r in history if r["split"] == "train"]

    def crash(step, record):
        if step == 3:
            raise Stop

    before = load_model(str(base)).hf.state_dict()
    straight = run(tmp_path / "a")[0].hf.state_dict()
    changed = [k for k in before if not torch.equal(before[k], straight[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # merged low-rank updates only
    with pytest.raises(Stop):
        run(tmp_path / "b", crash)
    model, steps = run(tmp_path / "b")
    assert steps == [3, 4]  # from the checkpoint of step 2, not from 0
    resumed = model.hf.state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_the_quantized_store_keys_on_the_adapter(base, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path / "home"))
    peft_adapter(base, tmp_path / "one", seed=1)
    peft_adapter(base, tmp_path / "two", seed=2)
    plain = logits(load_model(str(base), quantize="int8"))
    one = logits(load_model(str(base), quantize="int8", adapter=str(tmp_path / "one")))
    two = logits(load_model(str(base), quantize="int8", adapter=str(tmp_path / "two")))
    assert len(list((tmp_path / "home" / "quantized").glob("*.pt"))) == 3
    assert not torch.equal(plain, one) and not torch.equal(one, two)
    assert torch.equal(one, logits(load_model(str(base), quantize="int8", adapter=str(tmp_path / "one"))))


def test_cli_trains_an_adapter_and_generates_with_it(base, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
    args = ["train", "--objective", "ntp", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "run")]
    args += ["--steps", "2", "--seq-len", "32", "--batch-size", "2", "--lora-rank", "2"]
    args += ["--lr", "5e-2", "--warmup", "0"]  # enough to change the greedy output
    assert main(args) == 0
    capsys.readouterr()
    generate = ["generate", "--no-chat-template", "--max-new-tokens", "4", "--decoder", "ar", "--json"]
    assert main([*generate, "--model", str(tmp_path / "run"), "def"]) == 0
    via_model = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*generate, "--model", str(base), "--adapter", str(tmp_path / "run"), "def"]) == 0
    via_flag = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*generate, "--model", str(base), "def"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert via_model["token_ids"] == via_flag["token_ids"] != plain["token_ids"]  # the adapter changed the output
    bad = ["train", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "r2"), "--lora-rank", "-1"]
    assert main(bad) == 2
    assert "lora_rank must be >= 0" in capsys.readouterr().err


def on_int4_grid(base, out):
    """The base with every linear weight already on int4's grid (groups of 32, 16 levels), as SmolLM2's
    weights are: they come from a Q4_1 GGUF. The output layer (the embedding) too: int4 takes it whatever its
    number of rows."""
    model = load_model(str(base))
    with torch.no_grad():
        for module in [*model.hf.model.layers.modules(), model.hf.lm_head]:
            if isinstance(module, torch.nn.Linear):
                groups = module.weight.reshape(module.out_features, -1, 32)
                low = groups.amin(-1, keepdim=True).half().float()
                scale = ((groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15).half().float()
                codes = torch.round((groups - low) / scale.clamp_min(1e-12)).clamp(0, 15)  # a group of one value: 0
                module.weight.copy_((codes * scale + low).reshape_as(module.weight))
    model.save(out)
    return out


def small_adapter(base, out):
    """An adapter on every projection whose updates are a fraction of one int4 grid step."""
    wrapped = peft_adapter(base, out, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    wrapped.save_pretrained(out)


def test_int4_keeps_an_adapter_whose_updates_are_below_the_grid_step(base, tmp_path):
    """Merged and then quantized to int4, such an adapter rounds back to the base's codes and is lost;
    kept beside the int4 weights (QLoRA's way), the int4 model follows the adapter's float32 model."""
    grid = on_int4_grid(base, tmp_path / "grid")
    small_adapter(grid, tmp_path / "adapter")
    ids = (5, 17, 42, 9, 3, 88, 120, 7, 61, 200, 33, 14)
    adapted = logits(load_model(str(grid), adapter=str(tmp_path / "adapter")), ids)
    plain = logits(load_model(str(grid)), ids)
    at_int4 = logits(load_model(str(grid), quantize="int4", exact=True, adapter=str(tmp_path / "adapter")), ids)
    plain_int4 = logits(load_model(str(grid), quantize="int4", exact=True), ids)
    effect = (adapted - plain).abs().mean()
    error, base_error = (at_int4 - adapted).abs().mean(), (plain_int4 - plain).abs().mean()
    assert effect > 0.05  # the adapter matters at float32
    assert error < 0.5 * effect  # and still at int4 (merged, then quantized: 1.1 times the effect here)
    assert error < 1.5 * base_error  # no further from its float32 model than int4 puts the base from its own
    agree = (at_int4.argmax(-1) == adapted.argmax(-1)).float().mean()
    assert agree >= (plain_int4.argmax(-1) == adapted.argmax(-1)).float().mean()


def beside(module):
    """The layer that computes a projection: itself, or the fused layer of its group."""
    return module.group.fused if isinstance(module, FusedMember) else module


@pytest.mark.parametrize("kernel", ["native", "pytorch"])
def test_an_adapter_beside_int4_weights_is_lossless_and_kept_in_the_store(base, tmp_path, monkeypatch, kernel):
    """Row-invariant with the adapter kept apart: jacobi and lookup give ar's tokens at int4 --exact; the
    quantized store gives back the same model; a chain of two adapters keeps both updates side by side.
    On the native int4 kernel each projection and its update are one call; on PyTorch's, two layers."""
    if kernel == "native" and not native.available():
        pytest.skip("needs the native kernels")
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FASTFORWARD_INT4_KERNEL", kernel)
    grid = on_int4_grid(base, tmp_path / "grid")
    small_adapter(grid, tmp_path / "one")
    load_model(str(grid), adapter=str(tmp_path / "one")).save(tmp_path / "one-merged")
    small_adapter(tmp_path / "one-merged", tmp_path / "two")
    (tmp_path / "two" / PROVENANCE).write_text(json.dumps({"base": str(tmp_path / "one")}))
    model = load_model(str(tmp_path / "two"), quantize="int4", exact=True)
    projections = [m for n, m in model.hf.named_modules() if n.endswith("_proj")]
    kind = W4A8LowRankLinear if kernel == "native" else LowRankLinear
    assert len(projections) == 2 * 7 and all(isinstance(beside(m), kind) for m in projections)
    error = (logits(model) - logits(load_model(str(tmp_path / "two")))).abs().mean()
    base_error = (logits(load_model(str(grid), quantize="int4", exact=True)) - logits(load_model(str(grid)))).abs()
    assert error < 1.5 * base_error.mean()  # both updates kept (the first left out: 2.5 times the base's error here)
    again = load_model(str(tmp_path / "two"), quantize="int4", exact=True)  # from the store
    assert torch.equal(logits(again), logits(model))
    prompts = [model.encode_prompt(t, chat_template=False) for t in ("def add", "Tom has 3", "The quick")]
    ar = build_decoder("ar").generate(model, prompts, 24)
    for name, options in (("jacobi", {"block_size": 8}), ("lookup", {})):
        out = build_decoder(name, **options).generate(model, prompts, 24)
        assert [g.token_ids for g in out] == [g.token_ids for g in ar], name


@pytest.mark.skipif(not native.available(), reason="fused int4 layers need the native kernel")
def test_fused_adapted_projections_give_the_bits_of_separate_ones_and_trace_whole(base, tmp_path, monkeypatch):
    """Where projections that read one input are fused (compiled steps), an adapted group is one call of
    the native kernel with its updates side by side: the same logits as each projection apart (eager),
    and a graph without a break."""
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path / "home"))
    grid = on_int4_grid(base, tmp_path / "grid")
    small_adapter(grid, tmp_path / "adapter")
    apart = load_model(str(grid), quantize="int4", adapter=str(tmp_path / "adapter"))
    monkeypatch.setattr(Precision, "fuse", property(lambda precision: True))
    fused = load_model(str(grid), quantize="int4", adapter=str(tmp_path / "adapter"))
    members = [m for m in fused.hf.modules() if isinstance(m, FusedMember)]
    assert len({id(m.group) for m in members}) == 2 * 2  # query, key, value; gate, up: in each of 2 layers
    assert all(isinstance(beside(m), W4A8LowRankLinear) for m in members)
    ids = (5, 17, 42, 9, 3, 88, 120, 7, 61, 200, 33, 14)
    assert torch.equal(logits(fused, ids), logits(apart, ids))
    explanation = torch._dynamo.explain(fused.hf)(input_ids=torch.tensor([[3, 4, 5]]))  # not --exact: its hf breaks
    assert explanation.graph_break_count == 0


def test_a_chain_of_adapters_flattens_into_one_that_gives_the_same_model(base, tmp_path):
    """SFT then JF, say: one adapter of the summed rank over the first base, equal logits in float32, close
    in bfloat16; nothing but plain LoRA linear updates is flattened."""
    peft_adapter(base, tmp_path / "first", ("q_proj", "v_proj"), seed=0)
    peft_adapter(tmp_path / "first", tmp_path / "second", ("v_proj", "o_proj"), seed=1)
    (tmp_path / "second" / PROVENANCE).write_text(json.dumps({"base": str(tmp_path / "first")}))
    chain = logits(load_model(str(tmp_path / "second")))
    assert not torch.allclose(chain, logits(load_model(str(tmp_path / "first"))), atol=1e-3)

    flat = flatten([tmp_path / "first", tmp_path / "second"], tmp_path / "flat", str(base), dtype=torch.float32)
    config = json.loads((flat / ADAPTER_CONFIG).read_text())
    adapted = [f"model.layers.{i}.self_attn.{kind}" for i in range(2) for kind in ("o_proj", "q_proj", "v_proj")]
    assert (config["r"], config["target_modules"]) == (8, adapted)  # by full name: exactly the trained modules
    provenance = json.loads((flat / PROVENANCE).read_text())
    assert provenance["base"] == str(base)  # no intermediate step left
    # what ships names the folders it was made from by their names only
    assert provenance["flattened"] == [{"adapter": "first (a training folder)"}, {"base": "first (a training folder)"}]
    torch.testing.assert_close(logits(load_model(str(flat))), chain, rtol=1e-5, atol=1e-5)
    half = logits(load_model(str(flatten([tmp_path / "first", tmp_path / "second"], tmp_path / "bf16", str(base)))))
    assert (half - chain).abs().max() < 0.02 * (chain - logits(load_model(str(base)))).abs().max()

    dora = get_peft_model(load_model(str(base)).hf, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    dora.save_pretrained(tmp_path / "dora")
    with pytest.raises(FastForwardError, match="DoRA cannot be flattened"):
        flatten([tmp_path / "dora"], tmp_path / "no", str(base))


def test_a_shipped_adapter_loads_by_name_and_is_listed_among_the_presets(base, tmp_path, monkeypatch):
    from fastforward import shipped as catalogue
    from fastforward.model import presets

    shipped = tmp_path / "shipped"
    peft_adapter(base, shipped / "tiny-lora")
    monkeypatch.setattr(catalogue, "SHIPPED_ADAPTERS", shipped)
    by_name = load_model("tiny-lora")
    torch.testing.assert_close(logits(by_name), logits(load_model(str(shipped / "tiny-lora"))))
    assert "tiny-lora" in presets.preset_names()
    with pytest.raises(FastForwardError, match=r"give a preset \(smollm2-135m, tiny-lora\)"):
        load_model("no-such-model")
