"""Jacobi trajectories: the `jacobi` decoder's run, its fixed points greedy AR's and its states Jacobi
iterates of its own drafts; writing resumes cleanly."""

from __future__ import annotations

import json

import pytest
import torch

from fastforward.cli import main
from fastforward.decoding.decoders import ARDecoder
from fastforward.decoding.runtime import Prompt
from fastforward.decoding.sampling import random_tokens, row_key
from fastforward.errors import FastForwardError
from fastforward.model.tiny import tiny_model
from fastforward.training.trajectories.dataset import TrajectoryData, fit, only_correct
from fastforward.training.trajectories.records import Block, Trajectory, read_trajectories
from fastforward.training.trajectories.rollout import jacobi_decoder, rollouts
from fastforward.training.trajectories.writer import collect


def cut(response: list[int], stops: list[int], limit: int) -> list[int]:
    """What AR decoding returns: the response up to and including the first stop token, at most `limit`."""
    for i, token in enumerate(response):
        if token in stops:
            return response[: i + 1][:limit]
    return response[:limit]


def jacobi_update(model, context: list[int], state: list[int]) -> list[int]:
    """One Jacobi iteration of `state` after `context` (eq. 3), from a plain uncached forward."""
    with torch.inference_mode():
        logits = model.hf(torch.tensor([context + state])).logits[0]
    return logits[len(context) - 1 : len(context) + len(state) - 1].argmax(-1).tolist()


def trajectories(model, prompts, n: int, max_new_tokens: int, init: str = "repeat", seed: int = 0) -> list[list[Block]]:
    return [r.blocks for r in rollouts(model, jacobi_decoder(n, init, seed), prompts, max_new_tokens)]


@pytest.mark.parametrize("init", ["repeat", "random"])
@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_fixed_points_concatenated_equal_greedy_ar(tiny, prompts, n, init):
    collected = trajectories(tiny, prompts, n, max_new_tokens=14, init=init)
    total = -(-14 // n) * n  # whole blocks
    ar = ARDecoder().generate(tiny, prompts, max_new_tokens=total)
    for blocks, gen in zip(collected, ar, strict=True):
        assert len(blocks) == -(-14 // n)
        response = [t for b in blocks for t in b.fixed]
        assert cut(response, tiny.stop_token_ids, total) == gen.token_ids
        assert all(len(s) == n for b in blocks for s in b.trajectory)


@pytest.mark.parametrize("n", [3, 4])
def test_stop_token_inside_a_block_makes_it_the_last(tiny, prompts, n, stop_on):
    free = ARDecoder().generate(tiny, [prompts[0]], max_new_tokens=20)[0].token_ids
    at = next(i for i in range(5, 20) if i % n != n - 1 and free[i] not in free[:i])  # mid-block, first time
    with stop_on(free[at]):
        [blocks] = trajectories(tiny, [prompts[0]], n, max_new_tokens=40)
        ar = ARDecoder().generate(tiny, [prompts[0]], max_new_tokens=40)[0].token_ids
    assert len(blocks) == at // n + 1
    response = [t for b in blocks for t in b.fixed]
    assert cut(response, [free[at]], 40) == ar == free[: at + 1]
    # the tokens after the stop in its block are greedy AR's too: the block is decoded whole
    assert response == ARDecoder().generate(tiny, [Prompt(prompts[0], ignore_eos=True)], len(response))[0].token_ids


@pytest.mark.parametrize("init", ["repeat", "random"])
def test_states_are_the_decoders_drafts_then_jacobi_iterates(tiny, prompts, init):
    """Block 0 starts from the decoder's first token and its own drafts (random ones keyed by the seed,
    the prompt and the position); every point's Jacobi update is the next; the forwards are the
    decoder's: recording changes nothing of its run."""
    decoder = jacobi_decoder(4, init, seed=5)
    for prompt in prompts[:3]:
        [rollout] = rollouts(tiny, decoder, [prompt], 12)
        blocks = rollout.blocks
        first = blocks[0].fixed[0]
        origin = len(prompt)
        fill = (
            [first] * 3
            if init == "repeat"
            else random_tokens(row_key(5, prompt, []), range(origin + 1, origin + 4), tiny.vocab_size)
        )
        assert blocks[0].trajectory[0] == [first, *fill]
        context = list(prompt)
        for block in blocks:
            points = block.trajectory
            for state, following in zip(points, points[1:], strict=False):
                assert state != following
                assert jacobi_update(tiny, context, state) == following
            assert jacobi_update(tiny, context, block.fixed) == block.fixed
            assert len(points) <= 4 + 1  # every forward commits at least one more token
            context += block.fixed
        assert len(blocks) == 3
        alone = decoder.generate(tiny, [Prompt(prompt, ignore_eos=True)], 12)[0]
        assert rollout.forwards == alone.stats.nfe and [t for b in blocks for t in b.fixed] == alone.token_ids


def test_a_prompt_gets_the_same_trajectory_alone_or_in_a_batch(tiny, prompts):
    batched = trajectories(tiny, prompts, 3, max_new_tokens=12, init="random", seed=7)
    for prompt, blocks in zip(prompts, batched, strict=True):
        assert trajectories(tiny, [prompt], 3, max_new_tokens=12, init="random", seed=7)[0] == blocks
    assert trajectories(tiny, prompts[:1], 3, max_new_tokens=12, init="random", seed=8)[0] != batched[0]


def test_bad_knobs_are_refused(tiny, prompts, tmp_path):
    with pytest.raises(FastForwardError, match="draft-init"):
        collect(tiny, ["0"], tmp_path / "t.jsonl", block_size=3, init="pad", progress=False)
    with pytest.raises(FastForwardError, match="block size"):
        jacobi_decoder(0)
    with pytest.raises(FastForwardError, match="no room"):
        rollouts(tiny, jacobi_decoder(4), [[5] * 510], 12)
    assert not (tmp_path / "t.jsonl").exists()


# ---- writing and reading ------------------------------------------------------------------------
class Stop(Exception):
    pass


def test_killed_collection_resumes_without_duplicates(tiny, tmp_path):
    texts = ["def add(a, b):", "Tom has 3 apples", "The quick brown fox", "0", "1 + 2 =", "return a"]
    straight = tmp_path / "straight.jsonl"
    collect(tiny, texts, straight, block_size=3, max_new_tokens=9, batch_size=2, progress=False)

    path = tmp_path / "t.jsonl"
    seen = []

    def kill_after_three(trajectory):
        seen.append(trajectory.index)
        if len(seen) == 3:
            raise Stop

    with pytest.raises(Stop):
        collect(tiny, texts, path, block_size=3, max_new_tokens=9, batch_size=2, callback=kill_after_three)
    assert len(path.read_text().splitlines()) == 3
    with path.open("a") as f:
        f.write('{"index": 3, "prompt_ids": [1, 2')  # a line torn by the kill
    summary = collect(tiny, texts, path, block_size=3, max_new_tokens=9, batch_size=2, progress=False)
    assert (summary.skipped, summary.written) == (3, 3)
    lines = path.read_text().splitlines()
    assert sorted(json.loads(line)["index"] for line in lines) == list(range(len(texts)))
    assert sorted(lines) == sorted(straight.read_text().splitlines())
    again = collect(tiny, texts, path, block_size=3, max_new_tokens=9, progress=False)
    assert (again.skipped, again.written) == (len(texts), 0)

    with pytest.raises(FastForwardError, match="block size 3"):
        collect(tiny, texts, path, block_size=4, max_new_tokens=9, progress=False)
    with pytest.raises(FastForwardError, match="not among the prompts"):
        collect(tiny, texts[::-1], path, block_size=3, max_new_tokens=9, progress=False)


def test_records_round_trip(tiny, tmp_path):
    path = tmp_path / "t.jsonl"
    collect(tiny, ["Tom has", "0"], path, block_size=2, max_new_tokens=4, ids=["a", "b"], progress=False)
    first, second = read_trajectories(path)
    assert (first.index, first.id, first.prompt, second.id) == (0, "a", "Tom has", "b")
    assert first.prompt_ids == tiny.encode_prompt("Tom has")
    assert Trajectory.from_record(first.to_record()) == first


def test_collect_grades_each_response_up_to_its_stop(tiny, prompts, tmp_path):
    seen: list[tuple[int, str]] = []

    def grade(index: int, text: str) -> bool:
        seen.append((index, text))
        return index != 1

    path = tmp_path / "t.jsonl"
    summary = collect(tiny, prompts[:3], path, block_size=4, max_new_tokens=12, grade=grade, progress=False)
    trajectories = read_trajectories(path)
    assert [t.correct for t in trajectories] == [True, False, True] and summary.correct == 2
    for (index, text), t in zip(sorted(seen), trajectories, strict=True):
        ar = ARDecoder().generate(tiny, [prompts[index]], max_new_tokens=len(t.response))[0]
        assert text == ar.text and t.answer(tiny.stop_token_ids) == ar.token_ids
    assert Trajectory.from_record(trajectories[1].to_record()).correct is False
    with pytest.raises(FastForwardError, match="correct must be true or false"):
        Trajectory.from_record({**trajectories[0].to_record(), "correct": 1})


def test_only_correct_keeps_the_graded_correct_and_refuses_ungraded(tmp_path):
    block = [Block([], [5, 6])]
    graded = [Trajectory([1], block, 2, index=i, correct=c) for i, c in enumerate([True, False, True])]
    assert [t.index for t in only_correct(graded, "f")] == [0, 2]
    with pytest.raises(FastForwardError, match="1 of 2 trajectories in f carry no grade"):
        only_correct([graded[0], Trajectory([1], block, 2, index=3)], "f")
    with pytest.raises(FastForwardError, match="nothing to train on"):
        only_correct([graded[1]], "f")
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(t.to_record()) + "\n" for t in graded))
    assert len(TrajectoryData.from_file(path, 16)) == 3
    assert [t.index for t in TrajectoryData.from_file(path, 16, correct_only=True).examples] == [0, 2]


def test_training_data_fits_rows_and_counts_a_batchs_tokens():
    blocks = [Block([[9, 9]], [i, i + 1]) for i in range(5)]
    long = Trajectory(prompt_ids=[1, 2, 3], blocks=blocks, block_size=2)
    assert len(fit(long, 12).blocks) == 2  # 3 + 2·2·2 = 11 <= 12
    squeezed = fit(Trajectory(prompt_ids=list(range(20)), blocks=blocks, block_size=2), 8)
    assert (squeezed.prompt_ids, len(squeezed.blocks)) == (list(range(16, 20)), 1)
    with pytest.raises(FastForwardError, match="seq_len"):
        fit(long, 4)
    data = TrajectoryData([long, Trajectory([4], blocks[:1], 2, index=1)], seq_len=12)
    assert data.batch(0, 2, seed=1).n_tokens == 3 + 8 + 1 + 4
    assert data.fingerprint() != TrajectoryData([long], seq_len=12).fingerprint()


def test_training_batches_visit_each_example_once_an_epoch_in_an_order_of_the_seed():
    many = [Trajectory([i], [Block([], [i, i])], 2, index=i) for i in range(20)]

    def epoch(data: TrajectoryData, seed: int, number: int = 0) -> list[int]:
        """The examples of an epoch's five batches of 4, in the order the batches serve them."""
        return [t.index for b in range(5 * number, 5 * number + 5) for t in data.batch(b, 4, seed).examples]

    data = TrajectoryData(many, seq_len=12)
    orders = [epoch(data, 1), epoch(TrajectoryData(many, seq_len=12), 1), epoch(data, 2), epoch(data, 1, number=1)]
    assert all(sorted(order) == list(range(20)) for order in orders)  # each example once
    assert orders[0] == orders[1]  # a pure function of (seed, index): a resumed run sees the same batches
    assert orders[0] != orders[2] and orders[0] != orders[3]  # another seed, another epoch: another order
    assert data.batch(6, 4, seed=1).ids == [24, 25, 26, 27]  # each row's place in the stream seeds its draws


def test_cli_collects_a_task_and_resumes(tmp_path, capsys):
    tiny_model(init_std=0.5).save(tmp_path / "m")
    out = tmp_path / "t.jsonl"
    args = ["trajectories", "--model", str(tmp_path / "m"), "--task", "arithmetic", "--n", "3"]
    args += ["--out", str(out), "--block-size", "4", "--max-new-tokens", "8"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "3 prompts written" in printed and "of 3 responses graded correct" in printed
    assert main(args) == 0
    assert "0 prompts written, 3 already there" in capsys.readouterr().out
    assert [len(t.blocks) <= 2 and t.correct in (True, False) for t in read_trajectories(out)] == [True] * 3
    assert main([*args, "--prompts", str(out)]) == 2
    assert "exactly one of" in capsys.readouterr().err
    train = ["train", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "jf"), "--steps", "1"]
    assert main([*train, "--objective", "sbd", "--data", str(out), "--only-correct"]) == 2
    assert "use it with --objective jacobi_forcing" in capsys.readouterr().err
    # a random tiny model answers no arithmetic problem right
    assert main([*train, "--objective", "jacobi_forcing", "--trajectories", str(out), "--only-correct"]) == 2
    assert "nothing to train on" in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text('{"prompt": "Tom has"}\n')
    ungraded = [*args[:3], "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "u.jsonl")]
    assert main(ungraded) == 0 and "graded" not in capsys.readouterr().out
    assert (
        main([*train, "--objective", "jacobi_forcing", "--trajectories", str(tmp_path / "u.jsonl"), "--only-correct"])
        == 2
    )
    assert "carry no grade" in capsys.readouterr().err
