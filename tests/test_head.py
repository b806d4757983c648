"""The output layer and its losses a chunk of rows at a time (`fastforward.model.head`): the losses and
gradients of whole logits, for cross entropy with ignored rows and for distillation from a fixed teacher,
over several chunks, with the layer's weight trained or frozen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastforward.model import head
from fastforward.model.head import IGNORE, HeadRows

ROWS, WIDTH, VOCAB = 37, 24, 50


@pytest.fixture(params=[1 << 22, 7 * VOCAB], ids=["one-chunk", "chunks-of-7"])
def chunked(request, monkeypatch):
    monkeypatch.setattr(head, "CHUNK_FLOATS", request.param)


def tensors(weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, WIDTH, generator=g, requires_grad=True)
    weight = (torch.randn(VOCAB, WIDTH, generator=g) * 0.5).requires_grad_(weight_grad)
    return hidden, weight


@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen-head", "trained-head"])
def test_cross_entropy_equals_whole_logits_with_its_gradients(chunked, weight_grad):
    hidden, weight = tensors(weight_grad)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(1))
    targets[::5] = IGNORE
    inputs = [hidden, weight] if weight_grad else [hidden]
    got = head.cross_entropy(HeadRows(hidden, weight), targets) * 0.37  # a scaled use of the loss
    want = F.cross_entropy(F.linear(hidden, weight), targets, ignore_index=IGNORE, reduction="sum") * 0.37
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen-head", "trained-head"])
def test_distillation_from_the_rows_own_logits_equals_whole_logits(chunked, weight_grad):
    """Cross entropy of the rows and KL from some of them (each student row's teacher, held fixed) to the
    student rows, as whole logits give them, with their gradients."""
    hidden, weight = tensors(weight_grad)
    student = torch.randn(11, WIDTH, generator=torch.Generator().manual_seed(2), requires_grad=True)
    teacher = torch.randint(0, ROWS, (11,), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(1))
    targets[::4] = IGNORE
    ce, kl = head.cross_entropy_and_distillation(HeadRows(hidden, weight), targets, HeadRows(student, weight), teacher)
    logits = F.linear(hidden, weight)
    want_ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    teacher_log = F.log_softmax(logits[teacher], dim=-1).detach()
    want_kl = F.kl_div(F.log_softmax(F.linear(student, weight), dim=-1), teacher_log, log_target=True, reduction="sum")
    torch.testing.assert_close((ce, kl), (want_ce, want_kl), rtol=1e-5, atol=1e-5)
    inputs = [hidden, student, weight] if weight_grad else [hidden, student]
    got = torch.autograd.grad(0.3 * ce + 2.0 * kl, inputs, retain_graph=True)
    want = torch.autograd.grad(0.3 * want_ce + 2.0 * want_kl, inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert torch.autograd.grad(kl, hidden, allow_unused=True, materialize_grads=True)[0].abs().sum() == 0


def test_whole_logits_rows_take_the_same_functions():
    """A family whose logits change after its layer hands the losses its logits: the same results."""
    hidden, weight = tensors(False)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(1))
    rows, logits = HeadRows(hidden, weight), HeadRows(logits=F.linear(hidden, weight))
    torch.testing.assert_close(head.cross_entropy(logits, targets), head.cross_entropy(rows, targets))
    student, teacher = hidden[:5] * 0.5, torch.tensor([3, 0, 3, 7, 1])
    torch.testing.assert_close(
        head.cross_entropy_and_distillation(logits, targets, HeadRows(logits=F.linear(student, weight)), teacher),
        head.cross_entropy_and_distillation(rows, targets, HeadRows(student, weight), teacher),
    )


def test_no_gradient_is_made_under_no_grad():
    hidden, weight = tensors(True)
    with torch.no_grad():
        loss = head.cross_entropy(HeadRows(hidden, weight), torch.zeros(ROWS, dtype=torch.long))
    assert not loss.requires_grad and loss > 0
