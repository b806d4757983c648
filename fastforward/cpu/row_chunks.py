"""bfloat16 linear layers whose rows do not depend on each other: calls of at most `ROWS` rows.

oneDNN picks its bfloat16 GEMM kernel by the number of rows: on the 2-core Xeon here (AVX-512 BF16,
AMX) every row of a call of up to 32 rows came out the same bits as that row alone, for every
SmolLM2-135M projection shape and the output layer, and from 33 rows on they did not (measured on
random inputs, each row count from 1 to 300; `tests/test_row_chunks.py` checks it on the machine that
runs the tests). A decoding step of a batch runs rows × block tokens through every layer, so a row's
logits moved with what shared its batch. With `--exact`, bfloat16 linear layers run in calls of at
most 32 rows: a one-row step is one call as before, and a larger step is cut into calls that compute
each row exactly as a one-row call would.
"""

from __future__ import annotations

import torch
from torch import nn

ROWS = 32
LOW_PRECISION = (torch.bfloat16, torch.float16)


class RowChunkedLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) computed in calls of at most `ROWS` rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= ROWS:
            return super().forward(x)
        parts = [super(RowChunkedLinear, self).forward(part) for part in flat.split(ROWS)]
        return torch.cat(parts).reshape(*x.shape[:-1], -1)


def chunk_rows(model: nn.Module) -> int:
    """Make every bfloat16 or float16 `nn.Linear` of `model` a `RowChunkedLinear` (in place: the class
    changes, the parameters stay); returns how many."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype in LOW_PRECISION:
            module.__class__ = RowChunkedLinear
            changed += 1
    return changed
