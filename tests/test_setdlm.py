"""Set Diffusion: reveal orders, the set-causal training rule, and sliding-window decoding against a
slow reference that recomputes everything from scratch under the training rule."""

from __future__ import annotations

import json
import math

import pytest
import torch
from driving import decode
from test_objectives import make_batch

from fastforward.api import build_decoder, infill
from fastforward.cli import main
from fastforward.decoding.decoders import ARDecoder, Prompt
from fastforward.decoding.decoders.setdlm import SetDiffusionDecoder
from fastforward.decoding.runtime import start
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.model import Layout, visibility
from fastforward.model.tiny import tiny_model
from fastforward.training.objectives import SetDLM, make_objective
from fastforward.training.objectives.setdlm import hitting_times, middle_span, reveal_ranks

# Three clean tokens revealed in the order x2, x0, x1 (ranks 1, 2, 0), then their masks.
# Rows are queries, columns keys: [clean x0 x1 x2 ; masks m0 m1 m2].
RANKS_120 = """
101000
111000
001000
001100
101010
000001
"""


def test_reveal_order_rule_bit_by_bit():
    ranks = torch.tensor([[1, 2, 0]])
    drawn = torch.tensor([[c == "1" for c in row] for row in RANKS_120.split()])
    assert torch.equal(visibility.reveal_order(ranks, ranks)[0], drawn)


def _in_order_share(ranks: torch.Tensor) -> float:
    """Share of neighbouring positions revealed left before right."""
    return (ranks[:, 1:] > ranks[:, :-1]).float().mean().item()


def test_small_sets_are_nearly_left_to_right_large_ones_are_not():
    batch = make_batch([[5] * 64] * 200)
    narrow = reveal_ranks(batch.loss_mask, batch.valid, 1.0, 2.0, torch.Generator().manual_seed(0))
    wide = reveal_ranks(batch.loss_mask, batch.valid, 16.0, 32.0, torch.Generator().manual_seed(0))
    assert _in_order_share(narrow) > 0.85 > 0.7 > _in_order_share(wide) > 0.5
    # a position's rank stays within about max_set of its own index
    assert (narrow - torch.arange(64)).abs().max() <= 4


def test_prompt_first_in_order_padding_last():
    batch = make_batch([[1, 2, 3, 4, 5, 6, 0, 0]], loss_mask=[[0, 0, 0, 1, 1, 1, 0, 0]], valid=[[1] * 6 + [0, 0]])
    for seed in range(10):
        ranks = reveal_ranks(batch.loss_mask, batch.valid, 2.0, 4.0, torch.Generator().manual_seed(seed))[0].tolist()
        assert ranks[:3] == [0, 1, 2] and sorted(ranks[3:6]) == [3, 4, 5] and ranks[6:] == [6, 7]


def test_hitting_times_lie_in_their_windows_and_bad_sizes_are_clear():
    times = hitting_times(10, 2.0, 4.0, 100, torch.Generator().manual_seed(0))
    spacing = 1 / 13
    starts = torch.arange(10) * spacing
    assert (times >= starts).all() and (times <= starts + 4 * spacing).all()
    with pytest.raises(FastForwardError, match="does not fit"):
        hitting_times(10, 50.0, 2.0, 1, torch.Generator())


def test_objective_trains_masks_only_and_takes_an_ntp_term():
    model = tiny_model(seed=1)
    batch = make_batch(torch.randint(2, 250, (2, 16), generator=torch.Generator().manual_seed(0)).tolist())
    objective = SetDLM(ntp_weight=0.0)
    objective.setup(model)
    loss, metrics = objective.loss(model, batch, torch.Generator().manual_seed(0))
    assert metrics["masked"] == 32 and "ntp_loss" not in metrics
    loss.backward()
    with_ntp = SetDLM(ntp_weight=0.5).loss(model, batch, torch.Generator().manual_seed(0))[1]
    assert with_ntp["loss"] == pytest.approx(with_ntp["mask_loss"] + 0.5 * with_ntp["ntp_loss"], rel=1e-5)
    with pytest.raises(FastForwardError):
        make_objective("setdlm", set_size=0)


def test_infilling_rows_reveal_prefix_and_suffix_before_a_middle_span():
    valid = torch.tensor([[True] * 20 + [False] * 4])
    spans = [middle_span(valid, 5, torch.Generator().manual_seed(s))[0] for s in range(200)]
    for span in spans:
        where = span.nonzero()[:, 0]
        assert 1 <= len(where) <= 5 and where.diff().eq(1).all() and where.max() < 20  # one run, in the text
    assert {int(s.nonzero()[0]) for s in spans} == set(range(20))  # every start happens (spans shrink at the end)
    span = spans[0][None]
    ranks = reveal_ranks(span, valid, 2.0, 4.0, torch.Generator().manual_seed(0), context_first=True)[0]
    context = valid[0] & ~span[0]
    assert ranks[context].max() < ranks[span[0]].min()  # prefix and suffix come before every middle token
    assert ranks[~valid[0]].min() > ranks[valid[0]].max()  # padding last


def test_infill_share_makes_middles_the_only_targets_and_counts_them():
    model = tiny_model(seed=1)
    batch = make_batch(torch.randint(2, 250, (64, 16), generator=torch.Generator().manual_seed(0)).tolist())
    objective = SetDLM(infill_share=0.5, max_span=3, ntp_weight=0.0)
    objective.setup(model)
    targets, _ = objective.draw(batch, torch.Generator().manual_seed(1))
    per_row = targets.sum(1)
    assert ((per_row >= 1) & (per_row <= 3)).sum() > 10 and (per_row == 16).sum() > 10  # both kinds of row
    counted = objective.counts(model, batch, torch.Generator().manual_seed(1))
    assert counted["mask"] == int(targets.sum())
    _, metrics = objective.loss(model, batch, torch.Generator().manual_seed(1))
    assert metrics["masked"] == counted["mask"]
    assert torch.equal(SetDLM().draw(batch, torch.Generator().manual_seed(1))[0], batch.loss_mask)
    with pytest.raises(FastForwardError, match=r"infill share must be in \[0, 1\], got 2.0"):
        SetDLM(infill_share=2.0)


# ---- decoding ----------------------------------------------------------------------------------
def reference(
    model, prompt: list[int], window: int, threshold: float, budget: int, suffix=(), promote=False
) -> tuple[list[int], int]:
    """Sliding-window decoding with no cache: every step lays out the prompt, every token revealed
    so far (in reveal order; a step's tokens in position order) and the candidate masks, under
    the training rule. With a suffix, `budget` is the gap; the suffix follows the prompt in the
    order (up front) or joins it when the window first reaches it (promote). Returns the output
    (up to the first stop) and the number of forwards."""
    stops, mask_id = set(model.stop_token_ids), model.mask_token_id
    canvas: list[int | None] = [None] * budget
    suffix_at = [(budget + j, t) for j, t in enumerate(suffix)]
    revealed: list[tuple[int, int]] = [] if promote else suffix_at[:]  # (position, token) in cache order
    first_stop, forwards = budget, 0
    while True:
        frontier = next((p for p, t in enumerate(canvas) if t is None), budget)
        if frontier >= min(budget, first_stop + 1):
            break
        if promote:
            revealed += [(p, t) for p, t in suffix_at if frontier + window > p and (p, t) not in revealed]
        end = min(frontier + window, budget, first_stop + 1)
        candidates = [p for p in range(frontier, end) if canvas[p] is None]
        clean = [(i, t) for i, t in enumerate(prompt)] + [(len(prompt) + p, t) for p, t in revealed]
        tokens = [t for _, t in clean] + [mask_id] * len(candidates)
        positions = [p for p, _ in clean] + [len(prompt) + p for p in candidates]
        rule = visibility.reveal_order(torch.arange(len(clean))[None], torch.full((1, len(candidates)), len(clean)))
        layout = Layout(torch.tensor([tokens]), torch.tensor([positions]), rule, torch.arange(len(clean), len(tokens)))
        logits = model.run(layout, None)[0]
        logits[:, mask_id] = -math.inf
        confidence, choice = torch.softmax(logits, dim=-1).max(dim=-1)
        forwards += 1
        best = int(confidence.argmax())
        accepted = [(p, int(choice[i])) for i, p in enumerate(candidates) if i == best or confidence[i] >= threshold]
        for p, t in accepted:
            canvas[p] = t
            if t in stops:
                first_stop = min(first_stop, p)
        revealed += [(p, t) for p, t in sorted(accepted) if p <= first_stop]
    n = min(budget, first_stop + 1)
    return canvas[:n], forwards  # type: ignore[return-value]


@pytest.mark.parametrize("window, threshold", [(1, math.inf), (4, 0.2), (5, 0.5), (5, 0.9), (3, math.inf)])
def test_cached_decoding_equals_recomputing_under_the_training_rule(tiny, prompts, window, threshold):
    """At thresholds 0.5 and 0.9 this model often accepts a position while an earlier one stays
    masked, so tokens enter the cache out of position order."""
    decoder = SetDiffusionDecoder(window, threshold)
    for prompt in prompts:
        gen = decoder.generate(tiny, [prompt], max_new_tokens=14)[0]
        with torch.inference_mode():
            tokens, forwards = reference(tiny, prompt, window, threshold, 14)
        assert gen.token_ids == tokens
        assert gen.stats.nfe == forwards


def test_window_one_threshold_inf_is_one_token_per_forward_left_to_right(tiny, prompts):
    gens = SetDiffusionDecoder(1, math.inf).generate(tiny, prompts, max_new_tokens=9)
    for g in gens:
        assert g.stats.tokens_per_step == {1: len(g.token_ids)}


@pytest.mark.parametrize("window", [1, 4])
def test_first_token_from_ntp_at_threshold_inf_is_greedy_ar(tiny, prompts, cache_is_prefill, window):
    """Only the next-token prediction is accepted: AR, one token a forward, batched. With runs
    accepted too (threshold 0), what the cache holds is a causal prefill of the output so far."""
    decoder = SetDiffusionDecoder(window, math.inf, first_token_from_ntp=True)
    ar = ARDecoder().generate(tiny, prompts, max_new_tokens=11)
    gens = decoder.generate(tiny, prompts, max_new_tokens=11)
    assert [g.token_ids for g in gens] == [g.token_ids for g in ar]
    assert all(g.stats.tokens_per_step == {1: len(g.token_ids)} for g in gens)
    for prompt in prompts:
        with torch.inference_mode():
            session = start(tiny, [prompt], 11)
            decode(SetDiffusionDecoder(window, 0.0, first_token_from_ntp=True), session)
        cached = session.cache.get_seq_length()
        assert cached > len(prompt)
        cache_is_prefill(session.cache, (prompt + session.rows[0].output)[:cached])


def test_first_token_from_ntp_accepts_a_run_and_samples_as_ar(tiny, prompts):
    greedy = SetDiffusionDecoder(5, 0.0, first_token_from_ntp=True).generate(tiny, prompts, max_new_tokens=13)
    assert all(g.stats.nfe < len(g.token_ids) for g in greedy)  # threshold 0: the whole run at once
    single = [SetDiffusionDecoder(5, 0.0, first_token_from_ntp=True).generate(tiny, [p], 13)[0] for p in prompts]
    assert [g.token_ids for g in greedy] == [g.token_ids for g in single]
    sampler = Sampler(temperature=1.0, top_p=0.75)
    rows = [Prompt(p, seed=s) for s, p in enumerate(prompts)]
    sampled = SetDiffusionDecoder(3, math.inf, sampler=sampler, first_token_from_ntp=True).generate(tiny, rows, 12)
    assert [g.token_ids for g in sampled] == [g.token_ids for g in ARDecoder(sampler).generate(tiny, rows, 12)]
    with pytest.raises(FastForwardError, match="first_token_from_ntp"):
        SetDiffusionDecoder(first_token_from_ntp=True).generate(tiny, [Prompt(prompts[0], suffix=[5, 6], gap=3)], 3)


@pytest.mark.parametrize("window, threshold", [(5, 0.7), (5, 0.0)])
def test_batch_equals_one_at_a_time(tiny, prompts, window, threshold):
    decoder = SetDiffusionDecoder(window, threshold)
    batched = decoder.generate(tiny, prompts, max_new_tokens=13)
    single = [decoder.generate(tiny, [p], max_new_tokens=13)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    assert [g.stats.nfe for g in batched] == [g.stats.nfe for g in single]
    if threshold == 0.0:  # everything in the window accepted at once: several tokens per forward
        assert all(g.stats.nfe < len(g.token_ids) for g in single)


def test_stop_tokens_and_budget(tiny, prompts, stop_on):
    decoder = SetDiffusionDecoder(4, 0.2)
    free = decoder.generate(tiny, [prompts[1]], max_new_tokens=12)[0].token_ids
    stop = free[5]
    with stop_on(stop):
        gen = decoder.generate(tiny, [prompts[1]], max_new_tokens=12)[0]
        with torch.inference_mode():
            expected, _ = reference(tiny, prompts[1], 4, 0.2, 12)
    assert gen.token_ids == expected and gen.token_ids[-1] == stop and gen.finish_reason == "stop"
    assert all(len(g.token_ids) == 5 for g in decoder.generate(tiny, prompts, max_new_tokens=5))


def test_registry_and_bad_knobs():
    decoder = build_decoder("setdlm", window=6, threshold=math.inf)
    assert isinstance(decoder, SetDiffusionDecoder) and decoder.window == 6
    for bad in ({"window": 0}, {"threshold": -1.0}):
        with pytest.raises(FastForwardError):
            build_decoder("setdlm", **bad)


def test_cli_trains_setdlm_then_decodes(tmp_path, capsys):
    tiny_model(seed=2).save(tmp_path / "base")
    data = tmp_path / "d.jsonl"
    records = [{"prompt": f"{i} +", "completion": f" {i + 1} = {2 * i + 1}"} for i in range(24)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["train", "--objective", "setdlm", "--model", str(tmp_path / "base"), "--data", str(data)]
    args += ["--out", str(tmp_path / "run"), "--steps", "2", "--seq-len", "32", "--batch-size", "2"]
    args += ["--set-size", "2", "--max-set", "4"]
    assert main(args) == 0
    config = json.loads((tmp_path / "run" / "train_config.json").read_text())["objective"]
    assert config == {
        "name": "setdlm",
        "set_size": 2.0,
        "max_set": 4.0,
        "ntp_weight": 1.0,
        "infill_share": 0.0,
        "max_span": 8,
    }
    capsys.readouterr()
    gen = ["generate", "--model", str(tmp_path / "run"), "--decoder", "setdlm", "--window", "3", "--json"]
    assert main([*gen, "--max-new-tokens", "6", "1 +"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["stats"]["tokens"] <= 6


# ---- infilling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["upfront", "promote"])
@pytest.mark.parametrize("window, threshold", [(3, 0.5), (4, 0.9), (6, 0.0)])
def test_infilling_equals_the_reference_and_keeps_prefix_and_suffix(tiny, prompts, mode, window, threshold):
    decoder = SetDiffusionDecoder(window, threshold, suffix_cache=mode)
    rows = [Prompt(prompts[0], prompts[1], 7), Prompt(prompts[3], prompts[2], 9)]
    gens = decoder.generate(tiny, rows, max_new_tokens=50)
    for row, gen in zip(rows, gens, strict=True):
        with torch.inference_mode():
            tokens, forwards = reference(tiny, row.prefix, window, threshold, row.gap, row.suffix, mode == "promote")
        assert gen.token_ids == tokens and gen.stats.nfe == forwards
        assert len(gen.token_ids) == row.gap or gen.finish_reason == "stop"  # only the gap is written
    single = [decoder.generate(tiny, [row], max_new_tokens=50)[0].token_ids for row in rows]
    assert [g.token_ids for g in gens] == single


def test_the_suffix_changes_the_middle(tiny, prompts):
    decoder = SetDiffusionDecoder(4, 0.5)
    a = decoder.generate(tiny, [Prompt(prompts[0], prompts[1], 8)])[0].token_ids
    b = decoder.generate(tiny, [Prompt(prompts[0], prompts[2], 8)])[0].token_ids
    assert a != b


def test_only_setdlm_infills_and_ar_is_the_prefix_only_baseline(tiny, prompts):
    with pytest.raises(FastForwardError, match="cannot infill"):
        build_decoder("sbd").generate(tiny, [Prompt(prompts[0], prompts[1], 4)])
    gen = infill(tiny, "def add(a, b):", "return a", 6, "ar")[0]
    assert gen.token_ids == ARDecoder().generate(tiny, [tiny.encode_prompt("def add(a, b):", False)], 6)[0].token_ids
    with pytest.raises(FastForwardError, match="cannot infill"):
        infill(tiny, "x", "y", 3, "jacobi")
    with pytest.raises(FastForwardError, match="middle_tokens"):
        infill(tiny, "x", "y", 0)
    middle = infill(tiny, ["def add(a, b):", "Tom"], ["return a", "apples"], 5, "setdlm", window=3)
    assert [len(g.token_ids) for g in middle] == [5, 5]


def test_cli_infill(tmp_path, tiny, capsys):
    tiny.save(tmp_path / "m")
    args = ["infill", "--model", str(tmp_path / "m"), "--prefix", "def add(a, b):", "--suffix", "return a"]
    assert main([*args, "--middle-tokens", "5", "--window", "3", "--suffix-cache", "promote", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(record["token_ids"]) == 5 and record["stats"]["nfe"] >= 2
    assert main([*args, "--middle-tokens", "5", "--decoder", "mbd"]) == 2
    assert "cannot infill" in capsys.readouterr().err
