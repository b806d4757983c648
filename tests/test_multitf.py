"""MultiTF: noise-group layouts, slot-wise mask ratios, the group-aware dual-stream mask, the loss."""

from __future__ import annotations

import json

import pytest
import torch
from test_objectives import make_batch

from fastforward.cli import main
from fastforward.errors import FastForwardError
from fastforward.model import load_model, visibility
from fastforward.model.tiny import tiny_model
from fastforward.training.objectives import SBD, MultiTF, make_objective
from fastforward.training.objectives.multitf import draw_groups, group_ratios, random_groups, systematic_groups

# L = 8, block 2, groups [0, 0, 1, 1]: rows are queries, columns keys; [clean x1..x8 ; noisy x̂1..x̂8].
# Noisy block 0 sees itself; block 1 sees blocks 0-1 of the copy; blocks 2-3 (group 1) see clean
# blocks 0-1 and their group's noisy blocks up to themselves.
GROUPS_0011 = """
1000000000000000
1100000000000000
1110000000000000
1111000000000000
1111100000000000
1111110000000000
1111111000000000
1111111100000000
0000000011000000
0000000011000000
0000000011110000
0000000011110000
1111000000001100
1111000000001100
1111000000001111
1111000000001111
"""


def test_group_aware_mask_bit_by_bit():
    drawn = torch.tensor([[c == "1" for c in row] for row in GROUPS_0011.split()])
    rule = visibility.multitf_train(8, 2, torch.tensor([[0, 0, 1, 1], [0, 1, 2, 3]]))
    assert torch.equal(rule[0], drawn)
    assert torch.equal(rule[1], visibility.sbd_train(8, 2))  # one block per group is SBD's layout


def test_systematic_layouts_put_every_block_at_every_group_slot():
    assert systematic_groups(7, 3, 0) == [0, 0, 0, 1, 1, 1, 2]
    assert systematic_groups(7, 3, 2) == [0, 1, 1, 1, 2, 2, 2]
    for block in range(2, 7):  # away from the edges a block takes each slot of a 3-block group once
        slots = set()
        for shift in range(3):
            groups = systematic_groups(7, 3, shift)
            slots.add(groups[:block].count(groups[block]))
        assert slots == {0, 1, 2}
    assert systematic_groups(4, 1, 0) == [0, 1, 2, 3]


def test_random_layouts_have_consecutive_groups_within_the_size_bound():
    for seed in range(20):
        groups = random_groups(9, 3, torch.Generator().manual_seed(seed))
        assert len(groups) == 9 and groups[0] == 0
        assert all(b - a in (0, 1) for a, b in zip(groups, groups[1:], strict=False))
        assert max(groups.count(g) for g in set(groups)) <= 3


def test_layout_choice_and_group_bound():
    gen = torch.Generator().manual_seed(0)
    rows = draw_groups(400, 6, 3, "systematic", gen).tolist()
    shapes = {tuple(r) for r in rows}
    expected = {tuple(systematic_groups(6, s, h)) for s in (1, 2, 3) for h in range(s)}
    assert shapes == expected  # all six (size, shift) layouts are drawn, nothing else
    both = {tuple(r) for r in draw_groups(400, 6, 3, "both", gen).tolist()}
    assert both > expected  # random layouts add irregular ones


@pytest.mark.parametrize("schedule", ["chain-uniform", "d2f", "uniform", "fresh-tail"])
def test_ratios_increase_inside_each_group(schedule):
    groups = draw_groups(64, 8, 4, "both", torch.Generator().manual_seed(1))
    ratios = group_ratios(groups, schedule, torch.Generator().manual_seed(2))
    assert ratios.min() >= 0 and ratios.max() <= 1
    same_group = groups[:, 1:] == groups[:, :-1]
    steps = ratios[:, 1:] - ratios[:, :-1]
    assert (steps[same_group] >= 0).all()
    if schedule == "uniform":
        assert (steps[same_group] == 0).all()
    else:
        assert (steps[same_group] > 0).any()


def test_chain_uniform_draws_are_sorted_uniforms():
    groups = torch.zeros(20000, 2, dtype=torch.long)  # one group of two slots
    ratios = group_ratios(groups, "chain-uniform", torch.Generator().manual_seed(3))
    # the min and max of two uniforms have means 1/3 and 2/3
    assert ratios[:, 0].mean().item() == pytest.approx(1 / 3, abs=0.01)
    assert ratios[:, 1].mean().item() == pytest.approx(2 / 3, abs=0.01)


def test_fresh_tail_masks_the_last_block_of_half_the_multi_block_groups_wholly():
    groups = torch.tensor([[0, 0, 1, 2, 2, 2]]).repeat(4000, 1)  # groups of 2, 1 and 3 blocks
    ratios = group_ratios(groups, "fresh-tail", torch.Generator().manual_seed(5))
    plain = group_ratios(groups, "chain-uniform", torch.Generator().manual_seed(5))
    full = ratios == 1.0
    assert full[:, 1].float().mean().item() == pytest.approx(0.5, abs=0.03)  # last of the 2-block group
    assert full[:, 5].float().mean().item() == pytest.approx(0.5, abs=0.03)  # last of the 3-block group
    assert not full[:, [0, 2, 3, 4]].any()  # a group's other blocks, and a 1-block group, never
    assert torch.equal(ratios[~full], plain[~full])  # otherwise chain-uniform's draws


def test_loss_matches_sbd_with_one_block_groups():
    """max_group 1: the same layout as SBD, so the clean stream's NTP term is the same number."""
    model = tiny_model(seed=1)
    batch = make_batch(torch.randint(2, 250, (2, 24), generator=torch.Generator().manual_seed(0)).tolist())
    sbd, multitf = SBD(min_block=4, max_block=4), MultiTF(min_block=4, max_block=4, max_group=1)
    multitf.setup(model)
    _, a = sbd.loss(model, batch, torch.Generator().manual_seed(0))
    loss, b = multitf.loss(model, batch, torch.Generator().manual_seed(0))
    assert b["ntp_loss"] == pytest.approx(a["ntp_loss"], abs=1e-6)
    assert b["group_size"] == 1.0 and b["block"] == 4.0
    assert 0 < b["mask_rate"] < 1
    loss.backward()


def test_noisy_block_never_sees_a_later_group_or_its_own_clean_tokens():
    model = tiny_model(seed=1)
    mask_id = model.add_mask_token()
    x = torch.randint(2, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    groups = torch.tensor([[0, 0, 1]])  # blocks of 4: [0, 1] then [2]
    rule = visibility.multitf_train(12, 4, groups)
    tokens = torch.cat([x, torch.full_like(x, mask_id)], dim=1)
    positions = torch.arange(12).repeat(1, 2)

    def noisy_hidden(t):
        from fastforward.model import Layout

        layout = Layout(t, positions, visibility.over_cache(rule, 0, torch.ones(1, 24, dtype=torch.bool)))
        return model.hidden_states(layout)[0, 12:]

    before = noisy_hidden(tokens)
    changed = tokens.clone()
    changed[0, 0:8] = 7  # clean blocks 0-1: seen by group 1 only
    after = noisy_hidden(changed)
    assert torch.allclose(before[:8], after[:8]) and not torch.allclose(before[8:], after[8:])
    later = tokens.clone()
    later[0, 20:24] = 7  # the noisy block of group 1: seen by nothing in group 0
    assert torch.allclose(before[:8], noisy_hidden(later)[:8])


def test_bad_multitf_options_are_clear():
    with pytest.raises(FastForwardError, match="max group must be >= 1, got 0"):
        MultiTF(max_group=0)
    with pytest.raises(
        FastForwardError, match="layouts: unknown value 'diagonal'; choose one of systematic, random, both"
    ):
        MultiTF(layouts="diagonal")
    with pytest.raises(FastForwardError, match="schedule: unknown value 'cosine'"):
        make_objective("multitf", schedule="cosine")
    assert make_objective("multitf", max_group=2).describe()["max_group"] == 2


def test_cli_post_trains_a_mask_model_then_mbd_decodes_it(tmp_path, capsys):
    """`train --objective multitf` on an SBD-style model (mask token already there), then `generate`."""
    model = tiny_model(seed=2)
    mask_id = model.add_mask_token()
    model.save(tmp_path / "base")
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i} +", "completion": f" {i + 1} = {2 * i + 1}"}) + "\n" for i in range(24))
    )
    args = ["train", "--objective", "multitf", "--model", str(tmp_path / "base"), "--data", str(data)]
    args += ["--out", str(tmp_path / "run"), "--steps", "2", "--seq-len", "32", "--batch-size", "2"]
    args += ["--max-group", "2", "--layouts", "random", "--schedule", "d2f", "--min-block", "4", "--max-block", "4"]
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(1 <= r["group_size"] <= 2 for r in records if r["split"] == "train")
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["objective"]["schedule"] == "d2f"
    assert load_model(str(tmp_path / "run")).mask_token_id == mask_id
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "run"), "--decoder", "mbd", "--max-new-tokens", "6", "1 +"]) == 0


# L = 7, block 2 (the last block has one token), groups [0, 1, 1, 1]: a 3-block group after a 1-block
# one. Clean stream causal (rows 0-6) and blind to the copy; noisy block 0 (group 0) sees only itself;
# noisy blocks 1-3 (group 1) see the clean tokens of group 0 (x1, x2) and their group's noisy blocks up
# to and including their own (block-causal), never a later block nor any clean token of their group.
GROUPS_0111 = """
10000000000000
11000000000000
11100000000000
11110000000000
11111000000000
11111100000000
11111110000000
00000001100000
00000001100000
11000000011000
11000000011000
11000000011110
11000000011110
11000000011111
"""


def test_group_aware_mask_table_with_a_three_block_group_and_a_short_last_block():
    drawn = torch.tensor([[c == "1" for c in row] for row in GROUPS_0111.split()])
    assert torch.equal(visibility.multitf_train(7, 2, torch.tensor([[0, 1, 1, 1]]))[0], drawn)


def test_group_aware_mask_against_its_three_rules_written_out():
    """Every (query, key) of random layouts against the paper's three sentences, entry by entry."""
    gen = torch.Generator().manual_seed(4)
    length, block = 11, 3
    groups = draw_groups(16, 4, 3, "both", gen)
    rule = visibility.multitf_train(length, block, groups)
    for row in range(groups.shape[0]):
        g = [int(groups[row, i // block]) for i in range(length)]
        for q in range(2 * length):
            for k in range(2 * length):
                qi, ki = q % length, k % length
                if q < length:  # clean: causal over clean, never a noisy key
                    want = k < length and ki <= qi
                elif k < length:  # noisy -> clean: the clean prefix of its group
                    want = g[ki] < g[qi]
                else:  # noisy -> noisy: same group, block-causal
                    want = g[ki] == g[qi] and ki // block <= qi // block
                assert bool(rule[row, q, k]) == want, (row, q, k)


def test_a_noise_group_sees_what_the_mbd_decoder_shows_its_running_blocks():
    """Train-inference alignment of visibility: the noisy rows of a group, over [the clean prefix ;
    the group's noisy blocks], equal `mbd`'s rule for those running blocks after a cache holding the
    prefix (`block_causal_decode` with nothing to commit, every cached entry visible)."""
    length, block = 12, 2
    groups = torch.tensor([[0, 1, 1, 2, 2, 2]])  # a 3-block group starting at position 6
    rule = visibility.multitf_train(length, block, groups)[0]
    start, end = 6, 12
    noisy = slice(length + start, length + end)
    seen = torch.cat([rule[noisy, :start], rule[noisy, noisy]], dim=1)
    decode = visibility.over_cache(visibility.block_causal_decode(0, (2, 2, 2)), start)[0]
    assert torch.equal(seen, decode)
    assert not rule[noisy, start:length].any() and not rule[noisy, length : length + start].any()
