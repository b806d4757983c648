"""NTP and SBD objectives: the Fig. 8 layout, masking, labels, and what each half may see."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fastforward.errors import FastForwardError
from fastforward.model import MASK_CONFIG_KEY, adapters, visibility
from fastforward.model.tiny import tiny_model
from fastforward.training import lora
from fastforward.training.data import Batch
from fastforward.training.objectives import NTP, SBD, MultiTF, SetDLM, make_objective
from fastforward.training.objectives.base import IGNORE, causal_layout, next_token_labels
from fastforward.training.objectives.sbd import (
    draw_block,
    draw_block_suffixes,
    draw_masked,
    dual_stream_layout,
    sbd_layout,
)
from fastforward.training.objectives.setdlm import setdlm_layout

# SBD paper Fig. 8: L = 8, k = 4. Rows are queries, columns keys; [clean x1..x8 ; copy x̂1..x̂8].
FIG8 = """
1000000000000000
1100000000000000
1110000000000000
1111000000000000
1111100000000000
1111110000000000
1111111000000000
1111111100000000
0000000011110000
0000000011110000
0000000011110000
0000000011110000
1111000000001111
1111000000001111
1111000000001111
1111000000001111
"""


def make_batch(tokens: list[list[int]], loss_mask=None, valid=None) -> Batch:
    t = torch.tensor(tokens)
    ones = torch.ones_like(t, dtype=torch.bool)
    return Batch(
        t,
        ones if loss_mask is None else torch.tensor(loss_mask, dtype=torch.bool),
        ones if valid is None else torch.tensor(valid, dtype=torch.bool),
    )


@pytest.fixture
def model():
    return tiny_model(seed=1)


def test_training_visibility_is_fig8():
    drawn = torch.tensor([[c == "1" for c in row] for row in FIG8.split()])
    assert torch.equal(visibility.sbd_train(8, 4), drawn)


def test_sbd_layout_repeats_positions_and_labels_as_in_fig8():
    x = list(range(11, 19))  # x1..x8
    masked = torch.tensor([[c == "m" for c in "-m-mmm-m"]])  # Fig. 8: x1 m x3 m m m x7 m
    layout, labels = sbd_layout(make_batch([x]), masked, block=4, mask_id=99)
    m = 99
    assert layout.tokens.tolist() == [x + [11, m, 13, m, m, m, 17, m]]
    assert layout.positions.tolist() == [list(range(8)) * 2]
    # Clean position i → x_{i+1}; the row ends at x8, so its last clean position has no label (Fig. 8's x9).
    # Masked copy position i → x_i; unmasked copy positions carry no loss.
    n = IGNORE
    assert labels.tolist() == [x[1:] + [n] + [n, 12, n, 14, 15, 16, n, 18]]
    assert torch.equal(layout.visibility[0], visibility.sbd_train(8, 4))


def test_sbd_layout_hides_padding_keys():
    batch = make_batch([[1, 2, 3, 0]], loss_mask=[[1, 1, 1, 0]], valid=[[1, 1, 1, 0]])
    layout, labels = sbd_layout(batch, torch.tensor([[True, True, True, False]]), block=2, mask_id=9)
    seen = layout.visibility[0]
    assert not seen[[0, 1, 2, 4, 5, 6]][:, [3, 7]].any()  # real queries never see the pad (either copy)
    assert labels[0, 2] == IGNORE and labels[0, 7] == IGNORE  # no label is the pad, no pad is a label


def test_masking_draws_only_targets_and_follows_the_generator():
    loss_mask = torch.tensor([[False] * 8 + [True] * 56] * 64)
    draws = [draw_masked(loss_mask, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert not draws[0][:, :8].any()  # prompt tokens stay clean
    rates = draws[0][:, 8:].float().mean(1)
    assert rates.min() < 0.2 and rates.max() > 0.8  # η ~ U(0, 1) per row
    sizes = {draw_block(2, 16, torch.Generator().manual_seed(s)) for s in range(300)}
    assert sizes == set(range(2, 17))


def test_block_suffix_masking_reveals_a_left_part_and_masks_the_rest_of_each_block():
    loss_mask = torch.tensor([[False] * 3 + [True] * 19] * 200)
    masked = draw_block_suffixes(loss_mask, 4, torch.Generator().manual_seed(2))
    assert not masked[:, :3].any()  # prompt tokens stay clean
    for start in range(0, 22, 4):
        part = masked[:, start : start + 4].int()
        assert (part.diff(dim=1) >= 0).all()  # once masked, masked to the block's end
    # every cut happens: the last position of a block is always masked (cut < 4), the first sometimes
    assert masked[:, 7].all() and 0 < masked[:, 4].float().mean() < 1
    assert torch.equal(masked, draw_block_suffixes(loss_mask, 4, torch.Generator().manual_seed(2)))


def test_sbd_suffix_share_picks_the_masking_per_row(model):
    batch = make_batch([[5] * 32] * 64)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(
        SBD(suffix_share=0.0).draw(batch, generator).masked, SBD().draw(batch, torch.Generator().manual_seed(0)).masked
    )
    masking = SBD(min_block=4, max_block=4, suffix_share=1.0).draw(batch, generator)
    assert (masking.masked.view(64, 8, 4).int().diff(dim=2) >= 0).all()
    with pytest.raises(FastForwardError, match=r"suffix share must be in \[0, 1\], got 1.5"):
        SBD(suffix_share=1.5)


def test_sbd_setup_adds_a_recorded_mask_token(model):
    rows = model.hf.get_input_embeddings().num_embeddings
    SBD().setup(model)
    assert model.mask_token_id == rows
    assert getattr(model.hf.config, MASK_CONFIG_KEY) == model.mask_token_id
    assert model.hf.get_input_embeddings().num_embeddings == rows + 1


def test_clean_half_is_exactly_the_ntp_loss(model):
    sbd = SBD(min_block=3, max_block=5)
    sbd.setup(model)
    batch = make_batch(torch.randint(2, 250, (2, 24), generator=torch.Generator().manual_seed(0)).tolist())
    _, ntp_metrics = NTP().loss(model, batch, torch.Generator().manual_seed(0))
    _, sbd_metrics = sbd.loss(model, batch, torch.Generator().manual_seed(0))
    assert sbd_metrics["ntp_loss"] == pytest.approx(ntp_metrics["ntp_loss"], abs=1e-5)
    assert sbd_metrics["loss"] == pytest.approx(sbd_metrics["ntp_loss"] + sbd_metrics["mask_loss"], abs=1e-5)
    assert ntp_metrics["ntp_tokens"] == 2 * 23


def test_copy_never_sees_clean_tokens_of_its_own_block(model):
    mask_id = model.add_mask_token()
    x = torch.randint(2, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    masked = torch.ones_like(x, dtype=torch.bool)
    layout, _ = sbd_layout(make_batch(x.tolist()), masked, block=4, mask_id=mask_id)
    before = model.hidden_states(layout)[0, 12:]
    own = layout.tokens.clone()
    own[0, 4:8] = 7  # clean block 1: visible to copy block 2 only
    after = model.hidden_states(replace(layout, tokens=own))[0, 12:]
    assert torch.allclose(before[:8], after[:8]) and not torch.allclose(before[8:], after[8:])
    last = layout.tokens.clone()
    last[0, 8:12] = 7  # clean block 2: visible to no copy position
    assert torch.allclose(before, model.hidden_states(replace(layout, tokens=last))[0, 12:])


def test_ntp_ignores_padding(model):
    full = make_batch([[5, 6, 7, 8]])
    padded = make_batch([[5, 6, 7, 8, 0, 0]], loss_mask=[[1, 1, 1, 1, 0, 0]], valid=[[1, 1, 1, 1, 0, 0]])
    gen = torch.Generator()
    assert NTP().loss(model, padded, gen)[0].item() == pytest.approx(NTP().loss(model, full, gen)[0].item(), abs=1e-6)


def test_sbd_without_ntp_term_still_logs_it(model):
    sbd = SBD(ntp_weight=0.0)
    sbd.setup(model)
    batch = make_batch(torch.randint(2, 250, (2, 16), generator=torch.Generator().manual_seed(2)).tolist())
    loss, metrics = sbd.loss(model, batch, torch.Generator().manual_seed(0))
    assert metrics["ntp_loss"] > 0
    assert loss.item() == pytest.approx(metrics["mask_loss"])
    loss.backward()  # gradient flows through the masked term alone


def test_bad_objective_options_are_clear():
    with pytest.raises(FastForwardError, match="unknown objective"):
        make_objective("nope")
    with pytest.raises(FastForwardError, match="min_block <= max_block"):
        SBD(min_block=5, max_block=3)
    assert make_objective("ntp", max_block=4).describe() == {"name": "ntp"}


def full_logits_mean(model, layout, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy against `labels` [B, T] from transformers' logits of every slot of the layout
    (the path that projects everything, padding and prompts included)."""
    logits = model.run(replace(layout, read=torch.arange(layout.tokens.shape[1])), None)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def full_logits_loss(objective, model, batch: Batch, generator: torch.Generator) -> torch.Tensor:
    """Each objective's loss from `full_logits_mean`, its draws made as its own `loss` makes them."""
    ntp = full_logits_mean(model, causal_layout(batch), next_token_labels(batch))
    if isinstance(objective, NTP):
        return ntp
    if isinstance(objective, SetDLM):
        targets, ranks = objective.draw(batch, generator)
        layout, labels = setdlm_layout(batch, targets, ranks, model.mask_token_id)
        return full_logits_mean(model, layout, labels) + objective.ntp_weight * ntp
    masking = objective.draw(batch, generator)
    rule = objective.rule(batch.tokens.shape[1], masking, batch.tokens.device)
    layout, labels = dual_stream_layout(batch, masking.masked, rule, model.mask_token_id)
    length = batch.tokens.shape[1]
    clean, copy = labels.clone(), labels.clone()
    clean[:, length:], copy[:, :length] = IGNORE, IGNORE
    return full_logits_mean(model, layout, copy) + objective.ntp_weight * full_logits_mean(model, layout, clean)


@pytest.mark.parametrize(
    "objective",
    [NTP(), SBD(ntp_weight=0.5), MultiTF(min_block=2, max_block=4), SetDLM(ntp_weight=0.7)],
    ids=lambda o: o.name,
)
def test_losses_and_lora_gradients_equal_the_full_logits_path(objective):
    """Losses project only their labelled slots (`Model.logits_at`): the same loss and LoRA gradients as
    cross entropy over every slot's logits with the unlabelled ones ignored, on padded rows."""
    model = tiny_model(seed=1, init_std=0.5)
    objective.setup(model)
    lora.wrap(model, 4, 0.0, adapters.DEFAULT_TARGETS, seed=0)
    with torch.no_grad():  # LoRA's B starts at zero, which would leave A without gradient
        for name, p in model.hf.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    trained = [p for p in model.hf.parameters() if p.requires_grad]
    tokens = torch.randint(2, 250, (3, 20), generator=torch.Generator().manual_seed(4))
    valid = torch.arange(20) < torch.tensor([[20], [13], [17]])
    targets = valid & (torch.arange(20) >= torch.tensor([[5], [3], [8]]))  # prompts carry no loss
    batch = Batch(tokens.masked_fill(~valid, model.pad_token_id), targets, valid)
    loss, _ = objective.loss(model, batch, torch.Generator().manual_seed(2))
    expected = full_logits_loss(objective, model, batch, torch.Generator().manual_seed(2))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(loss, trained), torch.autograd.grad(expected, trained), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
