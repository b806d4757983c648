"""The output layer and the losses read from it, a chunk of rows at a time (training).

A loss over a large vocabulary reads logits [N, V]: made whole in float32 they are hundreds of MB a
training step (SmolLM2: 196 KB a row), and the log-softmax, its backward, the gather of the read slots
and the scatter back each pass over them again in memory. Here each chunk of rows is projected into one
buffer, turned into its loss and the gradient of that loss in place, and dropped: what the backward pass
keeps is the gradient of the hidden rows [N, H] (and of the layer's weight when it is trained).
Losses and gradients are those of the whole-logits computation up to float summation order; under
autocast both products run at its dtype, as the layer's own forward and backward would.

Distillation from the model's own rows (Jacobi Forcing's consistency loss: each noisy slot against the
clean slot it should match, held fixed) reads each teacher row's logits in the chunk that projects it for
its own cross entropy, so no row is projected twice.

Only a plain output layer (a linear map, no bias) is projected here. A family that changes logits after
its layer (Gemma 2's soft-capping, Cohere's and Granite's scales) gets its logits from its own forward
(`Model.outputs_at`), and the same loss functions take them whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100  # a row without a target (Hugging Face's convention)
# Logits a chunk: 128 MB of float32, 682 rows of SmolLM2's vocabulary; smaller chunks slow the products more than
# they save in memory traffic (`benchmarks/head_loss.py`, figures in docs/notes/2026-12-07-training-speed.md).
CHUNK_FLOATS = 1 << 25


@dataclass
class HeadRows:
    """The rows a loss reads: hidden states [N, H] under a plain output layer's `weight` [V, H], or, for a
    family whose logits are changed after its layer, the logits themselves [N, V] (`logits`)."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.hidden if self.logits is None else self.logits)


def cross_entropy(rows: HeadRows, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of `rows` against `targets` [N] (IGNORE: no term), in float32 (float64 models: float64)."""
    if rows.logits is not None:
        return F.cross_entropy(rows.logits.float(), targets, ignore_index=IGNORE, reduction="sum")
    empty = rows.hidden[:0]
    no_students = torch.zeros(0, dtype=torch.long, device=targets.device)
    wanted = (_wanted(rows.hidden), False, _wanted(rows.weight))
    return _ChunkedHeadLoss.apply(rows.hidden, empty, rows.weight, targets, no_students, wanted)[0]


def cross_entropy_and_distillation(
    rows: HeadRows, targets: torch.Tensor, student: HeadRows, teacher: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross entropy of `rows` against `targets`, summed KL(rows[teacher] ‖ student)): the teacher rows
    held fixed (the KL term sends no gradient to them); float32."""
    if rows.logits is not None:
        ce = F.cross_entropy(rows.logits.float(), targets, ignore_index=IGNORE, reduction="sum")
        teacher_log = F.log_softmax(rows.logits[teacher].float(), dim=-1).detach()
        student_log = F.log_softmax(student.logits.float(), dim=-1)
        return ce, F.kl_div(student_log, teacher_log, log_target=True, reduction="sum")
    wanted = (_wanted(rows.hidden), _wanted(student.hidden), _wanted(rows.weight))
    return _ChunkedHeadLoss.apply(rows.hidden, student.hidden, rows.weight, targets, teacher, wanted)


def _wanted(tensor: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


def _cross_entropy_chunk(
    logits: torch.Tensor, targets: torch.Tensor, gradient: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's summed cross entropy and, with `gradient`, its gradient with respect to `logits`, made in
    `logits`' own memory (no chunk-sized allocation: on a CPU each is page-faulted in afresh)."""
    kept = targets != IGNORE
    picked = logits.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    top = logits.amax(dim=1, keepdim=True)
    total = logits.sub_(top).exp_().sum(dim=1)
    loss = ((total.log() + top[:, 0] - picked) * kept).sum()
    if not gradient:
        return loss, None
    logits.div_(total[:, None])
    rows = kept.nonzero()[:, 0]
    logits[rows, targets[rows]] -= 1.0
    return loss, logits.mul_(kept[:, None])


def _distillation_chunk(
    student: torch.Tensor, teacher: torch.Tensor, gradient: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed KL(teacher ‖ student) of a chunk of logits and, with `gradient`, its gradient for the student's,
    made in the two tensors' own memory."""
    teacher.sub_(teacher.logsumexp(dim=1, keepdim=True))
    student.sub_(student.logsumexp(dim=1, keepdim=True))
    teacher_p = teacher.exp()
    loss = teacher.sub_(student).mul_(teacher_p).sum()
    return loss, (student.exp_().sub_(teacher_p) if gradient else None)


class _ChunkedHeadLoss(torch.autograd.Function):
    """(cross entropy of hidden @ Wᵀ against targets, KL from rows hidden[teacher] to student @ Wᵀ), summed,
    a chunk of `hidden`'s rows at a time, with the students whose teachers are in the chunk.

    The gradients are made in the forward pass and scaled by each loss's upstream gradient in the backward
    pass (a scalar: every use of a loss is a linear combination of loss terms)."""

    @staticmethod
    def forward(ctx, hidden, student, weight, targets, teacher, wanted):  # noqa: D102 (torch's signature)
        wants_hidden, wants_student, wants_weight = wanted
        rows = max(1, CHUNK_FLOATS // weight.shape[0])
        exact = torch.promote_types(weight.dtype, torch.float32)  # losses in float32, or a float64 model's dtype
        ce = torch.zeros((), dtype=exact, device=hidden.device)
        kl = torch.zeros((), dtype=exact, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if wants_hidden else None
        grad_student = torch.zeros_like(student) if wants_student else None
        weight_grads = [torch.zeros_like(weight, dtype=exact) for _ in range(2)] if wants_weight else None
        order = torch.argsort(teacher)  # students by their teacher row, so each chunk's are consecutive
        sorted_teacher = teacher[order]
        buffer = hidden.new_empty((min(rows, len(hidden)), weight.shape[0]), dtype=exact)  # one chunk's logits
        for start in range(0, len(hidden), rows):
            end = min(start + rows, len(hidden))
            part = hidden[start:end]
            logits = _project(part, weight, buffer[: end - start])
            lo, hi = torch.searchsorted(sorted_teacher, torch.tensor([start, end], device=teacher.device)).tolist()
            if hi > lo:  # this chunk's students, against its logits before the cross entropy's gradient takes them
                mine = order[lo:hi]
                student_part = student[mine]
                student_logits = _project(student_part, weight, buffer.new_empty((hi - lo, weight.shape[0])))
                loss, grad = _distillation_chunk(
                    student_logits, logits[sorted_teacher[lo:hi] - start], wants_student or wants_weight
                )
                kl += loss
                _backward_chunk(grad, weight, student_part, grad_student, mine, weight_grads, 1)
            loss, grad = _cross_entropy_chunk(logits, targets[start:end], wants_hidden or wants_weight)
            ce += loss
            _backward_chunk(grad, weight, part, grad_hidden, slice(start, end), weight_grads, 0)
        ctx.save_for_backward(grad_hidden, grad_student, *(weight_grads or ()))
        ctx.dtypes = (hidden.dtype, student.dtype, weight.dtype)
        return ce, kl

    @staticmethod
    def backward(ctx, upstream_ce, upstream_kl):  # noqa: D102
        grad_hidden, grad_student, *weight_grads = ctx.saved_tensors
        hidden_dtype, student_dtype, weight_dtype = ctx.dtypes
        scaled = lambda g, up, dtype: None if g is None else (g * up).to(dtype)  # noqa: E731
        weight_grad = None
        if weight_grads:
            weight_grad = (weight_grads[0] * upstream_ce + weight_grads[1] * upstream_kl).to(weight_dtype)
        return (
            scaled(grad_hidden, upstream_ce, hidden_dtype),
            scaled(grad_student, upstream_kl, student_dtype),
            weight_grad,
            None,
            None,
            None,
        )


def _project(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rows @ weightᵀ into `out` (float32 or float64): written there directly, or under autocast (or for weights
    of another dtype) made at their dtype as the layer's own forward would, then copied."""
    if out.dtype == weight.dtype == rows.dtype and not torch.is_autocast_enabled(rows.device.type):
        return torch.mm(rows, weight.t(), out=out)
    return out.copy_(F.linear(rows, weight))


def _backward_chunk(
    grad: torch.Tensor | None,
    weight: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor | None,
    where: slice | torch.Tensor,
    weight_grads: list[torch.Tensor] | None,
    loss: int,
) -> None:
    """A chunk's gradient with respect to its logits taken back to its hidden rows (at `where` in `grad_rows`)
    and to the layer's weight (`weight_grads[loss]`), under autocast at its dtype, as the layer's own backward."""
    if grad is None:
        return
    if grad_rows is not None:
        grad_rows[where] = torch.mm(grad.to(weight.dtype), weight).to(grad_rows.dtype)
    if weight_grads is not None:
        weight_grads[loss] += torch.mm(grad.t().to(rows.dtype), rows).to(weight_grads[loss].dtype)
