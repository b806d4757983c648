"""`fastforward recipe jacobi-forcing`: its data, its stages end to end on a tiny model, resuming, and its choice
of decoding defaults."""

from __future__ import annotations

import json

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.cli import main
from fastforward.errors import FastForwardError
from fastforward.model import load_model
from fastforward.model.tiny import tiny_model
from fastforward.recipes import dev_eval
from fastforward.recipes.records import Budget, Record, parse_budget, parse_record, read_records, split_dev
from fastforward.recipes.targets import reference_examples, self_answers
from fastforward.tasks.jsonl import grade_answer
from fastforward.training.data import PackedData
from fastforward.training.objectives.base import next_token_loss

GSM8K_LINES = [
    {"question": f"Tom has {a} apples and buys {b} more. How many?", "answer": f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}"}
    for a, b in ((3, 4), (5, 2), (2, 6), (9, 4), (8, 8), (3, 3))
]
for line in GSM8K_LINES:
    line["answer"] += "\n#### " + line["answer"].split(">>")[1]


def write_lines(path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


# ---- data -------------------------------------------------------------------------------------------------
def test_a_gsm8k_line_loses_its_calculator_marks_and_keeps_its_final_answer():
    record = parse_record(GSM8K_LINES[0], "x:1")
    assert record == Record("Tom has 3 apples and buys 4 more. How many?", "3+4 = 7\n#### 7", "7")
    assert parse_record({"prompt": "p", "answer": 12}, "x:1") == Record("p", None, "12")
    with pytest.raises(FastForwardError, match="x:1.*####"):
        parse_record({"question": "q", "answer": "no final line"}, "x:1")
    with pytest.raises(FastForwardError, match="x:2.*'prompt'"):
        parse_record({"text": "t"}, "x:2")
    with pytest.raises(FastForwardError, match="'completion' must be a non-empty string"):
        parse_record({"prompt": "p", "completion": ""}, "x:3")


def test_bad_data_files_say_what_is_wrong(tmp_path):
    with pytest.raises(FastForwardError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "p"}\n{not json\n')
    with pytest.raises(FastForwardError, match="bad.jsonl:2"):
        read_records(tmp_path / "bad.jsonl")


def test_the_dev_split_is_seeded_disjoint_and_keeps_the_order():
    records = [Record(f"p{i}") for i in range(20)]
    train, dev = split_dev(records, 5, seed=0)
    assert len(dev) == 5 and not set(train) & set(dev) and sorted(train + dev, key=records.index) == records
    assert split_dev(records, 5, seed=0) == (train, dev) and split_dev(records, 5, seed=1)[1] != dev
    for bad in (0, 20):
        with pytest.raises(FastForwardError, match="--dev"):
            split_dev(records, bad, seed=0)


def test_a_budget_is_tokens_or_time():
    assert parse_budget("3M") == Budget(tokens=3_000_000) and parse_budget("500k").tokens == 500_000
    assert parse_budget("1200") == Budget(tokens=1200)
    assert parse_budget("90min") == parse_budget("1.5h") == Budget(seconds=5400.0)
    for bad in ("", "3 apples", "-1M", "0"):
        with pytest.raises(FastForwardError, match="--budget"):
            parse_budget(bad)


def test_answers_are_graded_by_the_number_after_the_last_marker():
    assert grade_answer("so 3+4 = 7\n#### 7", "7").correct
    assert grade_answer("#### $1,000.", "1000").correct
    assert not grade_answer("#### 8", "7").correct and not grade_answer("7", "7").correct


# ---- targets ----------------------------------------------------------------------------------------------
def test_own_answers_are_the_models_greedy_output_and_resume_after_a_torn_line(tmp_path, tiny, stop_on):
    records = [Record(t) for t in ("Tom has 3 apples", "def add(a, b):", "0", "The quick brown fox")]
    path = tmp_path / "answers.jsonl"
    ar = build_decoder("ar").generate(tiny, [tiny.encode_prompt(r.prompt) for r in records], 8)
    with stop_on(ar[0].token_ids[2]):
        ar = build_decoder("ar").generate(tiny, [tiny.encode_prompt(r.prompt) for r in records], 8)
        stopped = [g for g in ar if g.finish_reason == "stop"]
        examples = self_answers(lambda: tiny, records, path, 8, batch_size=2)
    assert stopped and len(examples) == len(stopped)
    assert [e.ids[sum(not t for t in e.targets) :] for e in examples] == [g.token_ids for g in stopped]
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + lines[3][:10])  # killed while writing the fourth line

    def must_not_load():
        raise AssertionError("answers on file are not decoded again")

    with stop_on(ar[0].token_ids[2]):
        again = self_answers(lambda: tiny, records, path, 8, batch_size=2)
        assert again == examples and len(path.read_text().splitlines()) == 4
        assert self_answers(must_not_load, records, path, 8) == examples


# ---- the command ------------------------------------------------------------------------------------------
def recipe_args(tmp_path, data: str, method: str = "jacobi-forcing") -> list[str]:
    own = {"jacobi-forcing": ["--block-size", "4"], "setdlm": ["--max-set", "4"]}.get(method, ["--max-block", "4"])
    return [
        "recipe", method, "--model", str(tmp_path / "m"), "--data", data, "--work", str(tmp_path / "w"), *own,
        "--budget", "3k", "--dev", "2", "--seq-len", "64", "--batch-size", "2", "--blocks", "2", "4",
        "--curve", "2", "--curve-n", "1", "--max-new-tokens", "12", "--answer-tokens", "12", "--lora-rank", "2",
        "--targets", "reference", "--threads", "1",
    ]  # fmt: skip


def test_the_recipe_makes_a_preset_that_carries_its_defaults_and_resumes(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    data = write_lines(tmp_path / "gsm8k.jsonl", GSM8K_LINES)
    args = recipe_args(tmp_path, data)
    assert main([*args, "--ship-to", str(tmp_path / "preset")]) == 0
    out = capsys.readouterr().out
    assert "decoding defaults:" in out and "try it: fastforward generate --model" in out
    work, preset = tmp_path / "w", tmp_path / "preset"
    assert [len(read_records(work / f"{s}.jsonl")) for s in ("train", "dev")] == [4, 2]
    plan = json.loads((work / "plan.json").read_text())
    assert plan["sft_steps"] >= 1 and plan["jf_steps"] >= 1
    dev = json.loads((work / "dev.json").read_text())
    assert [p["step"] for p in dev["curve"]][0] == 0 and len(dev["curve"]) == 3
    assert set(dev["final"]) == {"ar", "lookup", "jacobi-2", "jacobi-4"}
    assert all(row["equal_ar"] == 2 for label, row in dev["final"].items() if label != "ar")  # lossless on dev
    assert "accuracy" in dev["final"]["ar"] and "base" in dev
    defaults = json.loads((preset / "decoding.json").read_text())
    assert defaults == dev["defaults"]
    provenance = json.loads((preset / "provenance.json").read_text())
    assert provenance["command"].startswith("fastforward recipe jacobi-forcing --data ")
    assert "--ar-weight 10.0" in provenance["command"] and provenance["data"]["source"] == "gsm8k.jsonl"
    assert "--budget 3000 " in provenance["command"]  # the tokens the budget came to, whatever it was given in
    assert "Jacobi Forcing" in provenance["description"]
    model = load_model(str(preset))  # the flattened adapter over the base
    prompt = [model.encode_prompt("Tom has 3 apples")]
    ar = build_decoder("ar").generate(model, prompt, 10)[0].token_ids
    assert build_decoder("jacobi", block_size=4).generate(model, prompt, 10)[0].token_ids == ar

    assert main([*args, "--micro-batch", "1"]) == 0  # a rerun (how it runs may change): nothing trained again
    out = capsys.readouterr().out
    assert "ntp from" not in out and "jacobi_forcing from" not in out and "dev final" not in out
    assert main([*args[:-2], "--lr", "0.5"]) == 2
    assert "other settings (lr)" in capsys.readouterr().err


def test_the_sbd_recipe_ships_an_sbd_model_whose_default_is_lossless(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    args = recipe_args(tmp_path, write_lines(tmp_path / "gsm8k.jsonl", GSM8K_LINES), "sbd")
    assert main([*args, "--final-n", "1", "--ship-to", str(tmp_path / "preset")]) == 0
    dev = json.loads((tmp_path / "w" / "dev.json").read_text())
    assert {row["n"] for row in dev["final"].values()} == {1} and dev["base"]["n"] == 1  # --final-n: the first 1
    plan = json.loads((tmp_path / "w" / "plan.json").read_text())
    assert plan["sbd_steps"] == round(plan["sbd_tokens"] / (2 * 64 * 2))  # a row read twice: clean and masked copy
    assert set(dev["curve"][0]) == {"step", "tokens", "ar"}  # the SFT start has no mask token yet
    sbd_rows = {"step", "tokens", "ar", "sbd-verified"}
    assert [set(point) for point in dev["curve"][1:]] == [sbd_rows] * 2  # the curve's snapshot has its mask token too
    assert {"sbd-verified-2", "sbd-verified-4", "sbd gamma 0.35", "sbd-slide gamma 0.35"} <= set(dev["final"])
    assert all(dev["final"][f"sbd-verified-{b}"]["equal_ar"] == 1 for b in (2, 4))  # lossless on dev
    assert dev["defaults"]["decoder"] in ("ar", "lookup", "sbd-verified")  # never a lossy one
    model = load_model(str(tmp_path / "preset"))
    assert model.mask_token_id is not None  # the shipped adapter brings SBD's mask token
    prompt = [model.encode_prompt("Tom has 3 apples")]
    ar = build_decoder("ar").generate(model, prompt, 10)[0].token_ids
    assert (
        build_decoder("sbd-verified", block_size=4, gamma=float("inf")).generate(model, prompt, 10)[0].token_ids == ar
    )
    provenance = json.loads((tmp_path / "preset" / "provenance.json").read_text())
    assert provenance["command"].startswith("fastforward recipe sbd ") and "--max-block 4" in provenance["command"]


def test_multitf_post_trains_the_sbd_recipes_model_on_its_dev_split(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    data = write_lines(tmp_path / "gsm8k.jsonl", GSM8K_LINES)
    sbd_preset = str(tmp_path / "sbd-preset")
    assert main([*recipe_args(tmp_path, data, "sbd"), "--final-n", "1", "--curve", "1", "--ship-to", sbd_preset]) == 0
    from fastforward.recipes.pipeline import reopen

    sbd = reopen(tmp_path / "w", log=lambda line: None)  # from its plan alone, to measure what it trained
    assert sbd.name == "sbd" and sbd.options.max_block == 4 and "sbd-verified-8" in sbd.final_decoders()
    with pytest.raises(FastForwardError, match="no recipe run"):
        reopen(tmp_path / "nothing")
    args = recipe_args(tmp_path, data, "multitf")
    args[args.index("--work") + 1] = str(tmp_path / "mtf")
    assert main(args) == 2 and "--start" in capsys.readouterr().err  # it needs the SBD model
    start = ["--start", sbd_preset, "--block", "2", "--buffer", "2", "--final-n", "1"]
    assert main([*args, *start, "--ship-to", str(tmp_path / "preset")]) == 0
    work = tmp_path / "mtf"
    plan, dev = (json.loads((work / f).read_text()) for f in ("plan.json", "dev.json"))
    assert plan["sft_steps"] == 0 and not (work / "sft").exists()
    assert read_records(work / "dev.jsonl") == read_records(tmp_path / "w" / "dev.jsonl")  # SBD's dev split
    assert set(dev["curve"][0]) == {"step", "tokens", "ar", "SingleBD", "mbd"}  # step 0: training-free on SBD
    assert dev["final"]["sbd-verified"]["equal_ar"] == 1 and dev["defaults"]["decoder"] != "mbd"
    provenance = json.loads((tmp_path / "preset" / "provenance.json").read_text())
    assert "--start " in provenance["command"] and "--no-sft" in provenance["command"]
    assert provenance["start"]["command"].startswith("fastforward recipe sbd ")  # how its start was made
    model = load_model(str(tmp_path / "preset"))  # SFT, SBD and MultiTF flattened over the base
    prompt = [model.encode_prompt("Tom has 3 apples")]
    ar = build_decoder("ar").generate(model, prompt, 10)[0].token_ids
    verified = build_decoder("sbd-verified", block_size=2, gamma=float("inf"))
    assert verified.generate(model, prompt, 10)[0].token_ids == ar


def test_the_setdlm_recipe_measures_its_rows_against_ar_and_keeps_a_lossless_default(tmp_path):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    args = recipe_args(tmp_path, write_lines(tmp_path / "gsm8k.jsonl", GSM8K_LINES), "setdlm")
    assert main([*args, "--final-n", "1", "--window", "2", "--micro-batch", "1"]) == 0
    config = json.loads((tmp_path / "w" / "setdlm" / "train_config.json").read_text())
    assert (config["train"]["batch_size"], config["train"]["grad_accum"]) == (1, 2)  # a step of 2 rows, 1 at a time
    assert "micro_batch" not in json.loads((tmp_path / "w" / "plan.json").read_text())["options"]
    dev = json.loads((tmp_path / "w" / "dev.json").read_text())
    assert set(dev["curve"][-1]) == {"step", "tokens", "ar", "setdlm ntp-first"}
    assert {"ar", "lookup", "setdlm", "setdlm ntp-first"} == set(dev["final"])
    assert dev["defaults"]["decoder"] in ("ar", "lookup")  # setdlm is lossy: never the default


def with_flags(args: list[str], **flags: str) -> list[str]:
    """`args` with each --flag's value replaced (or the flag added): `work=...` sets --work."""
    args = list(args)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def completion_loss(model_dir, records) -> float:
    """Mean NTP loss of a model over the records' reference completions."""
    model = load_model(str(model_dir))
    data = PackedData(reference_examples(records, model), 64, model.pad_token_id)
    with torch.no_grad():
        losses = [next_token_loss(model, batch)[0].item() for batch in data.in_order(4)]
    return sum(losses) / len(losses)


def test_from_continues_a_shipped_model_and_two_versions_end_where_one_run_ends(tmp_path, capsys):
    """--from: a second version trains the first's shipped adapter further (no SFT stage, a fresh optimizer);
    its provenance holds the first's, its curve counts on from the first's tokens. Two versions of 4k tokens
    end within a quarter of the first version's gain of one run of 8k tokens (NTP loss on the train
    completions; they differ by the second's fresh optimizer, warm-up and schedule, and its bfloat16 start)."""
    tiny_model(init_std=0.5).save(tmp_path / "m")
    args = with_flags(recipe_args(tmp_path, write_lines(tmp_path / "g.jsonl", GSM8K_LINES)), lr="0.02")
    args = [*args, "--no-sft"]
    first, second, whole = (tmp_path / name for name in ("first", "second", "whole"))
    assert main(with_flags(args, budget="4k", work=str(tmp_path / "w1"), ship_to=str(first))) == 0
    assert (
        main(with_flags(args, budget="4k", work=str(tmp_path / "w2"), ship_to=str(second), **{"from": str(first)})) == 0
    )
    assert main(with_flags(args, budget="8k", work=str(tmp_path / "w3"), ship_to=str(whole))) == 0
    capsys.readouterr()
    plan = json.loads((tmp_path / "w2" / "plan.json").read_text())
    assert plan["sft_steps"] == 0 and plan["from"]["adapter"] == str(first) and plan["from"]["rank"] == 2
    provenance = json.loads((second / "provenance.json").read_text())
    assert f"--from {first}" in provenance["command"] and provenance["start"]["command"].startswith("fastforward")
    assert "--from" not in provenance["start"]["command"]  # the first version continued nothing
    curves = [json.loads((folder / "provenance.json").read_text())["dev"]["curve"] for folder in (first, second)]
    assert curves[1][0]["tokens"] == curves[0][-1]["tokens"] > 0 and curves[1][-1]["tokens"] > curves[0][-1]["tokens"]
    records = read_records(tmp_path / "w1" / "train.jsonl")
    base, one, chain = (completion_loss(m, records) for m in (tmp_path / "m", whole, second))
    assert completion_loss(first, records) > chain  # the second version went on learning
    assert abs(chain - one) <= 0.25 * (base - one), (base, one, chain)


def test_from_refuses_what_it_cannot_continue(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    tiny_model(init_std=0.5, seed=3).save(tmp_path / "other")
    args = recipe_args(tmp_path, write_lines(tmp_path / "g.jsonl", GSM8K_LINES))
    assert main(with_flags(args, **{"from": str(tmp_path / "other")})) == 2
    assert "not an adapter folder" in capsys.readouterr().err
    assert main(with_flags(args, work=str(tmp_path / "w1"), ship_to=str(tmp_path / "jf"))) == 0
    capsys.readouterr()
    sbd = with_flags(
        recipe_args(tmp_path, write_lines(tmp_path / "g.jsonl", GSM8K_LINES), "sbd"), work=str(tmp_path / "w2")
    )
    assert main(with_flags(sbd, **{"from": str(tmp_path / "jf")})) == 2
    assert "was trained with jacobi_forcing, not sbd" in capsys.readouterr().err


def test_start_trains_the_method_from_a_shared_start_without_an_sft_stage(tmp_path, capsys):
    """--start: the method's stage trains over an adapter made elsewhere (one SFT start shared by several
    methods); no SFT stage runs, the curve's step 0 is that start, the shipped model holds both adapters."""
    tiny_model(init_std=0.5).save(tmp_path / "m")
    records = [parse_record(line, "x") for line in GSM8K_LINES]
    data = write_lines(tmp_path / "s.jsonl", [{"prompt": r.prompt, "completion": r.completion} for r in records])
    start = tmp_path / "start"
    sft = ["train", "--objective", "ntp", "--model", str(tmp_path / "m"), "--data", data, "--out", str(start),
           "--steps", "2", "--seq-len", "64", "--batch-size", "2", "--lora-rank", "2", "--threads", "1"]  # fmt: skip
    assert main(sft) == 0
    args = recipe_args(tmp_path, write_lines(tmp_path / "g.jsonl", GSM8K_LINES))
    assert main(with_flags(args, start=str(tmp_path / "m"))) == 2  # a model, not an adapter over it
    assert "not an adapter folder" in capsys.readouterr().err
    assert main([*with_flags(args, start=str(start)), "--from", str(start)]) == 2
    assert "leave out --start" in capsys.readouterr().err
    preset = tmp_path / "preset"
    assert main([*with_flags(args, start=str(start), curve="1", final_n="1"), "--ship-to", str(preset)]) == 0
    capsys.readouterr()
    work = tmp_path / "w"
    plan, dev = (json.loads((work / f).read_text()) for f in ("plan.json", "dev.json"))
    assert plan["sft_steps"] == 0 and not (work / "sft").exists() and plan["options"]["start"] == str(start)
    assert dev["curve"][0]["step"] == 0 and f"--start {start}" in (preset / "provenance.json").read_text()
    from fastforward.recipes.pipeline import reopen

    assert reopen(work, log=lambda line: None).start_chain() == [start]  # what the shipped adapter flattens first


def test_a_budget_in_time_sizes_each_stage_at_its_own_rate_measured_here(tmp_path):
    """--budget 0.05min: SFT gets its share of the seconds and the method the rest, each stage's steps from the
    rate of its own first steps here (its objective, its rows); the shipped command gives the tokens that came
    to, which plan the same steps on any machine."""
    from fastforward.recipes.jacobi_forcing import JacobiForcingRecipe

    tiny_model(init_std=0.5).save(tmp_path / "m")
    data = write_lines(tmp_path / "gsm8k.jsonl", GSM8K_LINES)
    options = JacobiForcingRecipe.options_class(
        model=str(tmp_path / "m"), budget="0.05min", dev=2, seq_len=64, batch_size=2, targets="reference",
        lora_rank=2, block_size=4,
    )  # fmt: skip
    recipe = JacobiForcingRecipe(data, tmp_path / "w", options, log=lambda line: None)
    assert (recipe.plan["budget_seconds"], recipe.plan["sft_seconds"], recipe.plan["jf_seconds"]) == (3.0, 0.75, 2.25)
    assert "budget_tokens" not in recipe.plan and "sft_steps" not in recipe.plan  # sized as each stage starts
    recipe.run(evaluate=False)
    plan = json.loads((tmp_path / "w" / "plan.json").read_text())
    assert plan["sft_tokens_per_s"] > 0 and plan["jf_tokens_per_s"] > 0 and plan["sft_steps"] >= 1
    again = JacobiForcingRecipe(data, tmp_path / "w", options, log=lambda line: None)  # resumed: not measured again
    assert again.plan == plan
    in_tokens = JacobiForcingRecipe(data, tmp_path / "w2", recipe._in_tokens(), log=lambda line: None)
    in_tokens.run(evaluate=False)
    tokens_plan = json.loads((tmp_path / "w2" / "plan.json").read_text())
    assert (tokens_plan["sft_steps"], tokens_plan["jf_steps"]) == (plan["sft_steps"], plan["jf_steps"])


def test_a_task_train_split_is_data_too_and_its_command_names_it(tmp_path, capsys):
    from fastforward.recipes.options import command_line
    from fastforward.recipes.pipeline import RECIPES
    from fastforward.recipes.records import TaskData

    tiny_model(init_std=0.5).save(tmp_path / "m")
    data = TaskData("arithmetic", 8, (("max_number", "20"),))
    recipe_class = RECIPES["jacobi-forcing"]
    options = recipe_class.options_class(model=str(tmp_path / "m"), budget="2k", dev=2, seq_len=64)
    recipe = recipe_class(data, tmp_path / "w", options, log=lambda line: None)
    train = recipe.train_records
    assert len(train) == 6 and all(r.completion.endswith("#### " + r.answer) for r in train)
    assert recipe.plan["data"] == data.name and recipe.plan["data_sha256"] == data.sha256()
    command = command_line("jacobi-forcing", options, data, tmp_path / "w")
    assert "--task arithmetic --task-option max_number=20 --problems 8 --work" in command
    args = ["recipe", "jacobi-forcing", "--model", str(tmp_path / "m"), "--work", str(tmp_path / "w2"), "--dev", "2"]
    assert main([*args, "--task", "arithmetic", "--problems", "1"]) == 2
    assert "--problems 1" in capsys.readouterr().err
    assert main([*args, "--data", "x.jsonl", "--problems", "5"]) == 2  # not silently ignored
    assert "--data FILE takes neither" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one or the other, as argparse refuses
        main([*args, "--task", "arithmetic", "--data", "x.jsonl"])
    assert "not allowed with" in capsys.readouterr().err


def test_the_recipe_refuses_what_it_cannot_do(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    prompts_only = write_lines(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    assert main(recipe_args(tmp_path, prompts_only)) == 2
    assert "--targets reference needs a completion" in capsys.readouterr().err
    args = recipe_args(tmp_path, write_lines(tmp_path / "g.jsonl", GSM8K_LINES))
    for flag, value, message in (("--budget", "soon", "--budget"), ("--dev", "6", "--dev 6")):
        i = args.index(flag)
        assert main([*args[:i], flag, value, *args[i + 2 :], "--work", str(tmp_path / flag)]) == 2
        assert message in capsys.readouterr().err


def test_a_decoder_far_slower_than_ar_on_the_first_prompts_stops_there_and_says_so(monkeypatch):
    """The dev split's time is bounded: a row below SLOW_SHARE of ar's tokens/s after SLOW_PROMPTS prompts
    decodes no more of them, and its row reports where and why it stopped."""
    from fastforward.decoding.rows import Generation, Stats

    class Fake:  # a decoder whose prompts take `seconds` for 10 tokens
        def __init__(self, seconds: float):
            self.seconds, self.calls = seconds, 0

        def generate(self, model, prompts, max_new_tokens):
            self.calls += 1
            return [Generation([1] * 10, "#### 7", Stats(nfe=10, tokens=10, seconds=self.seconds, prefill_seconds=0))]

    fakes = {"ar": Fake(1.0), "slow": Fake(10.0), "fine": Fake(2.0)}
    monkeypatch.setattr(dev_eval, "build_decoder", lambda name, **options: fakes[name])
    records, prompts = [Record(f"p{i}", answer="7") for i in range(8)], [[1]] * 8
    rows = dev_eval.table({name: (None, name, {}) for name in fakes}, records, prompts, 10)
    assert (fakes["ar"].calls, fakes["fine"].calls, fakes["slow"].calls) == (8, 8, dev_eval.SLOW_PROMPTS)
    assert rows["slow"]["n"] == 3 and rows["slow"]["stopped"].startswith("after 3 of 8 prompts: 0.10x ar's")
    assert "stopped" not in rows["fine"] and rows["fine"]["n"] == 8 and rows["slow"]["accuracy"] == 1.0


def test_defaults_go_to_a_lossless_decoder_only_when_it_pays():
    decoders = {"ar": ("ar", {}), "lookup": ("lookup", {}), "jacobi-8": ("jacobi", {"block_size": 8})}
    rows = {"ar": {"tps": 100.0, "tpf": 1.0, "n": 10}, "lookup": {"tps": 103.0, "tpf": 1.1, "n": 10, "equal_ar": 10}}
    rows["jacobi-8"] = {"tps": 160.0, "tpf": 3.0, "n": 10, "equal_ar": 9}  # fast, but not ar's tokens once
    assert dev_eval.choose_defaults(rows, decoders, "dev").decoder == "ar"  # lookup within the noise margin
    rows["jacobi-8"]["equal_ar"] = 10
    chosen = dev_eval.choose_defaults(rows, decoders, "10 dev prompts")
    assert (chosen.decoder, dict(chosen.options)) == ("jacobi", {"block_size": 8})
    assert chosen.measured.startswith("jacobi --block-size 8: 1.60x its own ar") and "10 dev prompts" in chosen.measured
