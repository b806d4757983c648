"""Jacobi Forcing: eq. 7 schedules, trajectory-point choice, the Fig. 2 packing rules, the loss, training end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.cli import main
from fastforward.errors import FastForwardError
from fastforward.model import Model, adapters, load_model
from fastforward.model.tiny import DEFAULT_CORPUS, fit_tokenizer, tiny_model
from fastforward.model.visibility import jacobi_forcing_train as jacobi_forcing_rule
from fastforward.training import lora
from fastforward.training.data import Example
from fastforward.training.objectives import JacobiForcing, make_objective
from fastforward.training.objectives.jacobi_forcing import (
    TAIL_POOL,
    attention_crossover,
    bin_capacity,
    choose_point,
    cut_after_stop,
    half_corrected,
    noise_ratios,
    pack,
    places,
    random_tail,
    row_length,
)
from fastforward.training.trainer import TrainConfig, train
from fastforward.training.trajectories.dataset import TrajectoryBatch, TrajectoryData, from_examples
from fastforward.training.trajectories.records import Block, Trajectory, read_trajectories
from fastforward.training.trajectories.writer import collect


# ---- schedule and trajectory points -------------------------------------------------------------
def test_noise_schedules_follow_eq7():
    assert noise_ratios(6, "progressive", 4) == [0, 0.25, 0.5, 0.75, 0, 0.25]
    assert noise_ratios(6, "reverse", 4) == [0.75, 0.5, 0.25, 0, 0.75, 0.5]
    assert noise_ratios(3, "progressive", 1) == [0, 0, 0]
    drawn = noise_ratios(50, "random", 4, torch.Generator().manual_seed(0))
    assert set(drawn) == {0, 0.25, 0.5, 0.75}
    assert drawn == noise_ratios(50, "random", 4, torch.Generator().manual_seed(0))
    with pytest.raises(FastForwardError, match="noise schedule"):
        noise_ratios(3, "cosine", 4)


def test_the_point_nearest_the_scheduled_ratio_is_chosen():
    # Unconverged fractions along the trajectory: 1, 0.75, 0.5, 0.5, 0.25, then the fixed point 0.
    block = Block([[9, 9, 9, 9], [1, 9, 9, 9], [1, 2, 9, 9], [1, 8, 3, 9], [1, 2, 3, 9]], [1, 2, 3, 4])
    assert [block.unconverged(s) for s in block.trajectory] == [1, 0.75, 0.5, 0.5, 0.25, 0]
    assert choose_point(block, 0.0) == [1, 2, 3, 4]
    assert choose_point(block, 0.2) == [1, 2, 3, 9]
    assert choose_point(block, 0.5) == [1, 2, 9, 9]  # a tie goes to the earlier point
    assert choose_point(block, 0.55) == [1, 2, 9, 9]
    assert choose_point(block, 0.7) == [1, 9, 9, 9]
    assert choose_point(block, 1.0) == [9, 9, 9, 9]
    assert choose_point(Block([], [5, 6]), 0.75) == [5, 6]  # nothing but the fixed point


# ---- packing ------------------------------------------------------------------------------------
def drawn(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in rows])


def test_noise_conditioned_rule_is_fig2b():
    #          p p n n c c n n c c
    expected = [
        "1000000000",  # p0
        "1100000000",  # p1
        "1110000000",  # noisy1 a: prompt, itself
        "1111000000",  # noisy1 b
        "1100100000",  # clean1 a: prompt, itself
        "1100110000",  # clean1 b
        "1111001000",  # noisy2 a: prompt, noisy1, itself
        "1111001100",  # noisy2 b
        "1100110010",  # clean2 a: prompt, clean1, itself
        "1100110011",  # clean2 b
    ]
    assert torch.equal(jacobi_forcing_rule(2, [2, 2], "noisy"), drawn(expected))


def test_clean_context_rule_is_fig2a():
    expected = [
        "1000000000",
        "1100000000",
        "1110000000",
        "1111000000",
        "1100100000",
        "1100110000",
        "1100111000",  # noisy2 a: prompt, clean1, itself
        "1100111100",
        "1100110010",
        "1100110011",
    ]
    assert torch.equal(jacobi_forcing_rule(2, [2, 2], "clean"), drawn(expected))


def test_packing_shares_positions_and_pairs_noisy_with_clean_slots():
    packed = pack([([7, 8], [[9, 9], [3, 9]], [[1, 2], [3, 4]]), ([5], [[1, 9]], [[1, 2]])], pad_id=0)
    layout = packed.layout
    assert layout.tokens.tolist() == [[7, 8, 9, 9, 1, 2, 3, 9, 3, 4], [5, 1, 9, 1, 2, 0, 0, 0, 0, 0]]
    assert layout.positions[0].tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
    assert layout.positions[1, :5].tolist() == [0, 1, 2, 1, 2]
    assert layout.visibility.shape == (2, 10, 10)
    assert not layout.visibility[1, :, 5:].any(-1)[:5].any()  # padding is never seen by real tokens
    noisy = list(zip(*(t.tolist() for t in packed.noisy), strict=True))
    read = list(zip(*(t.tolist() for t in packed.read), strict=True))
    assert noisy == [(0, 2), (0, 3), (0, 6), (1, 1)]  # a response's last slot has nothing to predict
    assert [read[j] for j in packed.teacher.tolist()] == [(0, 4), (0, 5), (0, 8), (1, 3)]
    labels = dict(zip(read, packed.labels.tolist(), strict=True))  # a response's last clean slot is not read
    assert labels == {(0, 1): 1, (0, 4): 2, (0, 5): 3, (0, 8): 4, (1, 0): 1, (1, 3): 2}
    assert packed.noise == pytest.approx(4 / 6)


def test_rows_share_bins_at_their_own_positions_and_see_only_themselves():
    rows = [([7, 8], [[9, 9], [3, 9]], [[1, 2], [3, 4]]), ([5], [[1, 9]], [[1, 2]]), ([6, 6, 6], [[2]], [[4]])]
    assert [row_length(r) for r in rows] == [10, 5, 5]
    assert places([10, 5, 5], 10) == [(0, 0), (1, 0), (1, 5)]  # first fit, longest first
    assert places([10, 5, 5]) == [(0, 0), (1, 0), (2, 0)]
    with pytest.raises(FastForwardError, match="cannot hold"):
        places([10, 5], 9)
    alone, binned = pack(rows, pad_id=0), pack(rows, pad_id=0, capacity=10)
    assert binned.places == [(0, 0), (1, 0), (1, 5)] and binned.layout.tokens.shape == (2, 10)
    assert binned.layout.tokens[1].tolist() == [5, 1, 9, 1, 2, 6, 6, 6, 2, 4]
    assert binned.layout.positions[1].tolist() == [0, 1, 2, 1, 2, 0, 1, 2, 3, 3]
    seen = binned.layout.visibility[1]
    assert not seen[:5, 5:].any() and not seen[5:, :5].any()  # neighbours in a bin never see each other
    assert torch.equal(seen[5:, 5:], alone.layout.visibility[2, :5, :5])
    assert torch.equal(binned.teacher, alone.teacher) and torch.equal(binned.labels, alone.labels)
    shift = {(2, 0): (1, 5), (1, 0): (1, 0), (0, 0): (0, 0)}  # row r at (bin, offset) instead of (r, 0)

    def moved(index):
        return [(shift[(r, 0)][0], shift[(r, 0)][1] + s) for r, s in zip(*(t.tolist() for t in index), strict=True)]

    assert moved(alone.noisy) == list(zip(*(t.tolist() for t in binned.noisy), strict=True))
    assert moved(alone.read) == list(zip(*(t.tolist() for t in binned.read), strict=True))


def test_bins_grow_only_while_padding_saved_outweighs_the_attention_it_adds():
    assert bin_capacity([100] * 8, crossover=1500) == 100  # equal rows: nothing to fill
    assert bin_capacity([200, 100, 100], crossover=1500) == 200  # the short rows pair up beside the long one
    assert bin_capacity([200, 120, 120, 120, 120], crossover=1500) == 250  # pairs of 120 in bins of 250
    assert bin_capacity([200, 100, 100, 100], crossover=1500) == 500  # 500 tokens in one bin beat 3 × 200 slots
    assert bin_capacity([200, 100, 100, 100], crossover=100) == 200  # attention dear: 3 bins of 200 rather


def test_blocks_are_cut_after_the_first_stop_token():
    noisy, clean = [[5, 6, 7], [8, 9, 1]], [[4, 5, 6], [0, 7, 8]]
    assert cut_after_stop(noisy, clean, [0]) == ([[5, 6, 7], [8]], [[4, 5, 6], [0]])
    assert cut_after_stop(noisy, clean, [6, 0]) == ([[5, 6, 7]], [[4, 5, 6]])
    assert cut_after_stop(noisy, clean, [3]) == (noisy, clean)
    trajectory = Trajectory([1, 2], [Block([[9, 9, 9]], [4, 5, 6]), Block([], [7, 0, 3])], 3)
    ((_, _, kept),) = JacobiForcing().rows(TrajectoryBatch([trajectory]), torch.Generator(), stop_ids=[0])
    assert kept == [[4, 5, 6], [7, 0]]


# ---- the loss -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, init_std=0.5)


def random_batch(model, clean_states: bool, seed: int = 0) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(seed)
    examples = []
    for index, (prompt_len, blocks) in enumerate([(3, 3), (5, 2)]):
        prompt = torch.randint(0, 200, (prompt_len,), generator=g).tolist()
        fixed = [torch.randint(0, 200, (4,), generator=g).tolist() for _ in range(blocks)]
        states = [[] if clean_states else [torch.randint(0, 200, (4,), generator=g).tolist()] for _ in fixed]
        examples.append(Trajectory(prompt, [Block(s, f) for s, f in zip(states, fixed, strict=True)], 4, index))
    return TrajectoryBatch(examples)


@pytest.mark.parametrize("context", ["noisy", "clean"])
def test_consistency_loss_is_zero_when_noisy_blocks_are_clean(model, context):
    objective = JacobiForcing(noisy_context=context, ar_weight=0.0)
    loss, metrics = objective.loss(model, random_batch(model, clean_states=True), torch.Generator())
    assert abs(loss.item()) < 1e-5 and metrics["noise"] == 0
    assert metrics["ar_loss"] > 0  # still logged


def test_noisy_blocks_give_a_positive_loss_whose_gradient_flows_through_the_student(model):
    objective = JacobiForcing(noise_schedule="progressive", noise_window=2, ar_weight=0.0)
    batch = random_batch(model, clean_states=False)
    loss, metrics = objective.loss(model, batch, torch.Generator())
    assert loss.item() > 0 and 0 < metrics["noise"] <= 1
    assert metrics["blocks"] == 2.5
    loss.backward()
    grads = [p.grad for p in model.hf.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.hf.zero_grad(set_to_none=True)


def test_ar_term_is_the_next_token_loss_of_the_clean_stream(model):
    batch = random_batch(model, clean_states=False)
    _, metrics = JacobiForcing(ar_weight=1.0).loss(model, batch, torch.Generator())
    total, count = 0.0, 0
    with torch.no_grad():
        for example in batch.examples:
            ids = example.prompt_ids + example.response
            logits = model.hf(torch.tensor([ids])).logits[0].float()
            start = len(example.prompt_ids) - 1
            targets = torch.tensor(ids[start + 1 :])
            total += torch.nn.functional.cross_entropy(logits[start:-1], targets, reduction="sum").item()
            count += len(targets)
    assert metrics["ar_loss"] == pytest.approx(total / count, rel=1e-4)


def reference_loss(model, rows: list, noisy_context: str, ar_weight: float) -> torch.Tensor:
    """Eq. 9 computed row by row, each row alone in a forward of transformers' own that returns logits for
    every slot (its family's output head included): what the packed path must give, which shares rows
    out over bins and projects only the slots a loss reads."""
    kl = ar = torch.zeros(())
    kl_count = ar_count = 0
    for prompt, noisy, clean in rows:
        lengths = [len(block) for block in clean]
        tokens, positions, students, readers = list(prompt), list(range(len(prompt))), [], [len(prompt) - 1]
        for noisy_block, clean_block in zip(noisy, clean, strict=True):
            n, at, start = len(clean_block), len(tokens), len(positions) - len(students)  # = prompt + done
            tokens += noisy_block + clean_block
            positions += [*range(start, start + n), *range(start, start + n)]
            students += range(at, at + n)
            readers += range(at + n, at + 2 * n)
        rule = jacobi_forcing_rule(len(prompt), lengths, noisy_context)
        logits = model.hf(
            input_ids=torch.tensor([tokens]), position_ids=torch.tensor([positions]), attention_mask=rule[None, None]
        ).logits[0]
        logp = logits.float().log_softmax(-1)
        response = [t for block in clean for t in block]
        for i, target in enumerate(response):  # readers[i] (the last prompt slot, then clean slots) predicts token i
            ar = ar - logp[readers[i], target]
        for i in range(len(response) - 1):  # noisy slot i against clean slot i (readers[i + 1]), detached
            teacher = logp[readers[i + 1]].detach()
            kl = kl + (teacher.exp() * (teacher - logp[students[i]])).sum()
        kl_count += len(response) - 1
        ar_count += len(response)
    return kl / kl_count + ar_weight * ar / ar_count


def varied_batch(seed: int = 0) -> TrajectoryBatch:
    """Trajectories of different prompt lengths and block counts, so that rows share bins."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for index, (prompt_len, blocks) in enumerate([(3, 3), (5, 2), (2, 1), (7, 1), (4, 2)]):
        prompt = torch.randint(2, 200, (prompt_len,), generator=g).tolist()
        fixed = [torch.randint(2, 200, (4,), generator=g).tolist() for _ in range(blocks)]
        states = [[torch.randint(2, 200, (4,), generator=g).tolist()] for _ in fixed]
        examples.append(Trajectory(prompt, [Block(s, f) for s, f in zip(states, fixed, strict=True)], 4, index))
    return TrajectoryBatch(examples)


def softcapped_gemma2(folder) -> Model:
    """A tiny Gemma 2 (final logit soft-capping at 30 and attention soft-capping), saved and loaded as a user's."""
    import transformers as T

    tokenizer = fit_tokenizer(DEFAULT_CORPUS, 300)
    config = T.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.5,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    assert config.final_logit_softcapping == 30.0
    torch.manual_seed(0)
    T.Gemma2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_model(str(folder))


@pytest.mark.parametrize(("family", "lora_rank"), [("llama", 0), ("llama", 4), ("gemma2", 4)])
@pytest.mark.parametrize("context", ["noisy", "clean"])
def test_binned_loss_and_its_gradients_equal_a_full_logits_forward_of_each_row_alone(
    family, lora_rank, context, tmp_path
):
    model = tiny_model(seed=0, init_std=0.5) if family == "llama" else softcapped_gemma2(tmp_path)
    if lora_rank:
        lora.wrap(model, lora_rank, 0.0, adapters.DEFAULT_TARGETS, seed=0)
        with torch.no_grad():  # LoRA's B starts at zero, which would leave A without gradient
            for name, p in model.hf.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    trained = [p for p in model.hf.parameters() if p.requires_grad]
    objective = JacobiForcing(noise_schedule="random", noise_window=4, noisy_context=context, ar_weight=0.7)
    batch = varied_batch()
    rows = objective.rows(batch, torch.Generator().manual_seed(3), model.stop_token_ids)
    lengths = [row_length(r) for r in rows]
    assert bin_capacity(lengths, attention_crossover(model)) > max(lengths)  # some rows do share a bin

    loss, _ = objective.loss(model, batch, torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(loss, trained)
    expected = reference_loss(model, rows, context, ar_weight=0.7)
    expected_grads = torch.autograd.grad(expected, trained)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        # float32 sums in another order: an AVX2-only EPYC's kernels left one element of 256 1.4e-6 apart
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-6)


def test_options_are_checked_and_text_batches_refused(model):
    with pytest.raises(FastForwardError, match="noise schedule: unknown value 'linear'"):
        make_objective("jacobi_forcing", noise_schedule="linear")
    with pytest.raises(FastForwardError, match="noisy context: unknown value 'mixed'"):
        JacobiForcing(noisy_context="mixed")
    with pytest.raises(FastForwardError, match="trajectories"):
        JacobiForcing().loss(model, object(), torch.Generator())


# ---- end to end ---------------------------------------------------------------------------------
TEXTS = ["def add(a, b):", "Tom has 3 apples", "The quick brown fox", "0", "1 + 2 =", "return a"]


def test_trains_end_to_end_through_the_common_trainer(tmp_path):
    model = tiny_model(seed=0, init_std=0.5)
    path = tmp_path / "t.jsonl"
    collect(model, TEXTS, path, block_size=4, max_new_tokens=12, batch_size=6, progress=False)
    data = TrajectoryData(read_trajectories(path), seq_len=40)
    config = TrainConfig(steps=12, seq_len=40, batch_size=3, lr=3e-3, warmup=2, save_every=0, eval_every=0)
    history = train(model, JacobiForcing(noise_window=3), data, config, tmp_path / "run")
    losses = [r["loss"] for r in history]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < sum(losses[:3])


def test_cli_trajectories_train_generate(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{t}"}}\n' for t in TEXTS))
    traj = tmp_path / "t.jsonl"
    collect_args = ["trajectories", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out", str(traj)]
    assert main([*collect_args, "--block-size", "4", "--max-new-tokens", "8"]) == 0
    train_args = ["train", "--objective", "jacobi_forcing", "--trajectories", str(traj), "--model", str(tmp_path / "m")]
    train_args += ["--out", str(tmp_path / "jf"), "--steps", "2", "--seq-len", "32", "--batch-size", "2"]
    assert main([*train_args, "--eval-fraction", "0.3", "--noise-window", "4"]) == 0
    assert main(["generate", "--model", str(tmp_path / "jf"), "--decoder", "jacobi", "--max-new-tokens", "6", "0"]) == 0
    assert "tokens/forward" in capsys.readouterr().err
    bad = ["train", "--objective", "jacobi_forcing", "--data", str(prompts), "--out", str(tmp_path / "x")]
    assert main(bad) == 2
    assert "--trajectories" in capsys.readouterr().err


def test_progressive_rounds_resume_by_skipping_finished_rounds(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{t}"}}\n' for t in TEXTS[:4]))
    args = ["jacobi-forcing", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out", str(tmp_path / "jf")]
    args += ["--rounds", "2", "--block-sizes", "2", "3", "--max-new-tokens", "6", "--steps", "2", "--seq-len", "24"]
    assert main(args) == 0
    for r, n in ((1, 2), (2, 3)):
        assert (tmp_path / "jf" / f"round-{r}" / "config.json").exists()
        assert {t.block_size for t in read_trajectories(tmp_path / "jf" / f"trajectories-round-{r}.jsonl")} == {n}
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "round 1: done" in out and "round 2: done" in out
    assert load_model(str(tmp_path / "jf" / "round-2")).hf is not None


def test_progressive_rounds_with_lora_chain_their_adapters(tmp_path, capsys):
    """Each round trains a LoRA adapter whose base is the previous round's (an adapter directory too): the last
    round's directory alone loads the base with every round merged, and jacobi on it equals its own AR."""
    tiny_model(init_std=0.5).save(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{t}"}}\n' for t in TEXTS[:4]))
    args = ["jacobi-forcing", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out", str(tmp_path / "jf")]
    args += ["--rounds", "2", "--block-sizes", "2", "3", "--max-new-tokens", "6", "--steps", "2", "--seq-len", "24"]
    assert main([*args, "--lora-rank", "2", "--lr", "0.05"]) == 0
    rounds = [tmp_path / "jf" / f"round-{r}" for r in (1, 2)]
    assert all((r / "adapter_config.json").exists() and not (r / "config.json").exists() for r in rounds)
    assert json.loads((rounds[1] / "fastforward_adapter.json").read_text())["base"] == str(rounds[0].resolve())
    one, two, base = (load_model(str(p)) for p in (rounds[0], rounds[1], tmp_path / "m"))
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.inference_mode():
        logits = [m.hf(input_ids=ids).logits for m in (base, one, two)]
    assert not torch.allclose(logits[0], logits[1]) and not torch.allclose(logits[1], logits[2])
    prompt = [two.encode_prompt(TEXTS[0])]
    ar = build_decoder("ar").generate(two, prompt, 12)[0].token_ids
    assert build_decoder("jacobi", block_size=4).generate(two, prompt, 12)[0].token_ids == ar


# ---- state sources ------------------------------------------------------------------------------
def test_random_tail_replaces_the_rightmost_tokens_by_tokens_from_before_them():
    before, block = list(range(100, 300)), [1, 2, 3, 4, 5, 6, 7, 8]
    for ratio, k in ((0.0, 0), (0.25, 2), (0.5, 4), (0.9375, 8)):
        noisy = random_tail(before, block, ratio, torch.Generator().manual_seed(k))
        assert noisy[: 8 - k] == block[: 8 - k] and len(noisy) == 8
        pool = set((before + block[: 8 - k])[-TAIL_POOL:])
        assert all(t in pool for t in noisy[8 - k :])  # drawn from the 128 tokens before the tail
    draws = {tuple(random_tail(before, block, 0.5, torch.Generator().manual_seed(s))) for s in range(5)}
    assert len(draws) == 5  # another stream, other tokens
    assert set(random_tail([], [7, 8], 1.0, torch.Generator())) <= {7, 8}  # nothing before: the block's own


def test_half_corrected_sets_half_of_the_wrong_tokens_right():
    fixed, state = [1, 2, 3, 4, 5, 6], [9, 2, 9, 9, 5, 9]  # 4 wrong
    out = half_corrected(state, fixed, torch.Generator().manual_seed(0))
    assert sum(a != b for a, b in zip(out, fixed, strict=True)) == 2
    assert all(o in (s, f) for o, s, f in zip(out, state, fixed, strict=True))


def test_ground_truth_responses_train_with_random_tail_states_and_no_rollout(model):
    examples = [
        Example([1, 2, 3, 10, 11, 12, 13, 14], [False] * 3 + [True] * 5),
        Example([4, 20, 21], [False, True, True]),
    ]
    references = from_examples(examples, block_size=4, pad_id=0)
    assert [b.fixed for b in references[0].blocks] == [[10, 11, 12, 13], [14, 0, 0, 0]]
    assert references[0].prompt_ids == [1, 2, 3] and all(not b.states for b in references[0].blocks)
    batch = TrajectoryBatch(references)
    objective = JacobiForcing(noise_schedule="random", noise_window=4, states="random-tail")
    (prompt, noisy, clean), _ = objective.rows(batch, torch.Generator().manual_seed(0), stop_ids=[0])
    assert prompt == [1, 2, 3] and clean == [[10, 11, 12, 13], [14, 0]] and len(noisy[1]) == 2  # cut after the stop
    loss, metrics = objective.loss(model, batch, torch.Generator().manual_seed(0))
    assert loss.item() > 0 and metrics["noise"] > 0
    again, _ = objective.loss(model, batch, torch.Generator().manual_seed(0))
    assert again.item() == loss.item()  # a row's draws are a function of the seed and its place
    with pytest.raises(FastForwardError, match="random-tail"):
        JacobiForcing(noise_schedule="random", noise_window=4).rows(batch, torch.Generator().manual_seed(1))
    with pytest.raises(
        FastForwardError, match="states: unknown value 'oracle'; choose one of rollout, random-tail, rollout-aug"
    ):
        JacobiForcing(states="oracle")


def test_rollout_aug_starts_from_the_recorded_state_and_corrects_half(model):
    trajectory = Trajectory([1], [Block([[9, 9, 9, 9]], [4, 5, 6, 7])], 4)
    objective = JacobiForcing(noise_schedule="progressive", noise_window=1, states="rollout-aug")
    ((_, (noisy,), _),) = objective.rows(TrajectoryBatch([trajectory]), torch.Generator())
    assert noisy == [4, 5, 6, 7]  # ratio 0: the fixed point, nothing to correct
    objective = JacobiForcing(noise_schedule="reverse", noise_window=2, states="rollout-aug")
    ((_, (noisy,), _),) = objective.rows(TrajectoryBatch([trajectory]), torch.Generator())
    assert sum(a == 9 for a in noisy) == 2 and sum(a != b for a, b in zip(noisy, [4, 5, 6, 7], strict=True)) == 2


def test_cli_trains_jacobi_forcing_on_ground_truth_data(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "completion": " = 3"}) + "\n" for t in TEXTS))
    args = ["train", "--objective", "jacobi_forcing", "--data", str(data), "--model", str(tmp_path / "m")]
    args += ["--out", str(tmp_path / "jf"), "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--block-size", "4"]
    assert main([*args, "--states", "random-tail", "--noise-schedule", "random", "--noise-window", "4"]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "jf" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [1, 2]
    assert main([*args[:-8], "--out", str(tmp_path / "x")]) == 2
    assert "--states random-tail" in capsys.readouterr().err


def test_progressive_rounds_on_reference_responses_collect_nothing(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "completion": " = 3"}) + "\n" for t in TEXTS[:4]))
    args = ["jacobi-forcing", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out", str(tmp_path / "jf")]
    args += ["--rounds", "1", "--block-sizes", "4", "--steps", "2", "--seq-len", "32", "--states", "random-tail"]
    assert main([*args, "--noise-schedule", "random", "--noise-windows", "4"]) == 0
    assert "4 reference responses in blocks of 4" in capsys.readouterr().out
    assert not list((tmp_path / "jf").glob("trajectories-*"))
    assert (tmp_path / "jf" / "round-1" / "config.json").exists()
    prompts.write_text('{"prompt": "no answer"}\n')
    assert main([*args, "--noise-windows", "4", "--out", str(tmp_path / "x")]) == 2
    assert "completion" in capsys.readouterr().err
