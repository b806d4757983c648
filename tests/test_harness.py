"""The lm-evaluation-harness model: generation equals `fastforward generate`, scores equal a direct
computation, and lm-eval runs it end to end on a local task."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from fastforward.api import generate  # noqa: E402
from fastforward.errors import FastForwardError  # noqa: E402
from fastforward.evaluation.harness import FastForwardLM, cut_at_stops  # noqa: E402
from fastforward.evaluation.lm_eval_tasks import write_tasks  # noqa: E402

PROMPTS = ["def add(a, b):", "Tom has 3 apples", "The quick brown fox jumps over"]


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    tiny.save(folder)
    return str(folder)


def _requests(kind, args_list):
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


@pytest.mark.parametrize("decoder, knobs", [("jacobi", {"block_size": "4"}), ("sbd-verified", {"block_size": "4"})])
def test_generate_until_equals_fastforward_generate(tiny, saved, decoder, knobs):
    lm = FastForwardLM(pretrained=saved, decoder=decoder, batch_size=2, **knobs)
    settings = {"until": ["e"], "max_gen_toks": 12}
    got = lm.generate_until(_requests("generate_until", [(p, settings) for p in PROMPTS]))
    ours = generate(tiny, PROMPTS, decoder, max_new_tokens=12, chat_template=False, block_size=4)
    assert got == [cut_at_stops(g.text, ["e"]) for g in ours]
    assert lm.summary()["tokens"] == sum(g.stats.tokens for g in ours) and lm.summary()["tpf"] > 0
    assert lm.summary()["queries"] == sum(g.stats.queries for g in ours)


def test_loglikelihoods_equal_a_direct_computation(tiny, saved):
    lm = FastForwardLM(pretrained=saved)
    pairs = [("def add(a, b):", " return a + b"), ("Tom has", " 3 apples")]
    scores = lm.loglikelihood(_requests("loglikelihood", pairs))
    for (context, continuation), (logprob, greedy) in zip(pairs, scores, strict=True):
        whole = tiny.tokenizer(context + continuation)["input_ids"]
        n = len(whole) - len(tiny.tokenizer(context)["input_ids"])
        with torch.inference_mode():
            logp = torch.log_softmax(tiny.hf(input_ids=torch.tensor([whole])).logits[0].float(), dim=-1)
        expected = sum(float(logp[i - 1, whole[i]]) for i in range(len(whole) - n, len(whole)))
        assert logprob == pytest.approx(expected, abs=1e-4) and greedy in (True, False)
    (rolling,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [("def add(a, b): return a",)]))
    ids = [lm.prefix_token_id, *tiny.tokenizer("def add(a, b): return a")["input_ids"]]
    with torch.inference_mode():
        logp = torch.log_softmax(tiny.hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    assert rolling == pytest.approx(sum(float(logp[i - 1, ids[i]]) for i in range(1, len(ids))), abs=1e-4)


def test_bad_model_arguments_are_clear(saved):
    with pytest.raises(FastForwardError, match="not an option of the ar decoder"):
        FastForwardLM(pretrained=saved, decoder="ar", block_size="4")
    with pytest.raises(FastForwardError, match="unknown decoder"):
        FastForwardLM(pretrained=saved, decoder="nope")


def test_lm_eval_runs_the_model_on_a_local_task(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path / "tasks", n=2, max_gen_toks=8, max_ops=3, max_number=20, max_factor=5)
    stats = tmp_path / "stats.json"
    results = lm_eval.simple_evaluate(
        model="fastforward",
        model_args=f"pretrained={saved},decoder=jacobi,block_size=4,stats_path={stats},ar_baseline=True",
        tasks=["ff_arithmetic"],
        task_manager=lm_eval.tasks.TaskManager(include_path=str(tmp_path / "tasks")),
    )
    assert "exact_match,final_answer" in results["results"]["ff_arithmetic"]
    summary = json.loads(stats.read_text())
    assert summary["requests"] == 2 and summary["ar_tps"] > 0 and summary["tokens"] <= 16
