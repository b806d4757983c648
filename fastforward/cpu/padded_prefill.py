"""A left-padded batch prefilled in one forward, each row's attention computed as if it were alone.

`--exact` promises that a prompt's tokens do not depend on what shares its batch. Its linear layers
compute every row alone already (`row_chunks`, the int kernels); a prefill's attention does not: under
left padding a row's keys sit at other offsets and its softmax sums over masked zeros in another
order, so its cache entries and logits came out a few bits apart from a one-prompt prefill. Inside
`rows_apart(pads)` the `--exact` attention functions hand a prefill to `attend_rows_apart`, which runs
the model's own prefill attention on each row's unpadded queries and keys, with the mask a one-prompt
prefill gets (the batch's, cut to the row), and leaves the padded queries' outputs zero (their cache
entries are never seen). So a batch is prefilled in one forward, its linear layers in large calls,
and each row's entries and logits are the bits a one-prompt prefill gives. A layer whose prefill
kernel rounds by row count (PyTorch's int4 kernel's bfloat16 copies, `quantize.prefill_kernels`)
runs each row's tokens alone too (`each_row`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_pads: ContextVar[Sequence[int] | None] = ContextVar("fastforward_padded_prefill", default=None)


@contextmanager
def rows_apart(pads: Sequence[int]) -> Iterator[None]:
    """Within: a prefill's `--exact` attention runs row by row; pads[b] = row b's leading pad tokens."""
    token = _pads.set(pads)
    try:
        yield
    finally:
        _pads.reset(token)


def attend_rows_apart(
    attention: Callable[..., tuple[torch.Tensor, None]],
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`attention` (query [B, H, T, d]; key, value [B, Hkv, T, d]; mask [B, 1, T, T] or None; returns
    [B, T, H, d]) on the whole batch, or, inside `rows_apart`, on each row from its first real token."""
    pads = _pads.get()
    if pads is None or query.shape[0] == 1:
        return attention(module, query, key, value, attention_mask, *args, **kwargs)
    batch, heads, length, dim = query.shape
    out = query.new_zeros(batch, length, heads, dim)
    for row, pad in enumerate(pads):
        mask = None if attention_mask is None else attention_mask[row : row + 1, :, pad:, pad:]
        rows = [t[row : row + 1, :, pad:].contiguous() for t in (query, key, value)]
        out[row, pad:] = attention(module, *rows, mask, *args, **kwargs)[0][0]
    return out, None


def each_row(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, width: int) -> torch.Tensor | None:
    """Inside `rows_apart`: `function` on each row's own tokens of x [B, T, in] (the rows a one-prompt
    prefill gives it), zeros at the padding, [B, T, width]; None outside, or for another batch."""
    pads = _pads.get()
    if pads is None or x.dim() != 3 or x.shape[0] != len(pads):
        return None
    out = x.new_zeros(*x.shape[:-1], width)
    for row, pad in enumerate(pads):
        out[row, pad:] = function(x[row, pad:])
    return out
