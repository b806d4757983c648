"""A batch being decoded: its rows and one KV cache; rows join and leave it between steps.

Whoever starts a batch makes its rows (`fastforward.decoding.rows`) and prefills them (`prefilled`,
`fastforward.decoding.prefill`), and so for rows that join it. Every decoder then drives the
`Session` the same way, one step at a time (`Decoder.step`):

    logits = session.forward(tokens, positions, rule, read)   # one layout; its new entries enter the cache
    tokens = session.sampler.sample(logits, positions)        # greedy, or sampled with each position's own draw
    steps.commit_writes(session, writes) / steps.append(session, tokens)  # tokens onto the rows' canvases
    session.advance(keep)                                     # which new cache entries stay; closes the step

`forward` counts a forward for every row taking part (NFE) and refuses to run while the previous
step is open; `advance` settles the cache and records, per row, how many tokens the step
committed (the tokens-per-step histogram). So no decoder keeps its own statistics. Nothing runs
inside a step but the decoder: whoever drives the batch reads the rows after `Decoder.step` returns.

`session.rows` holds one `Row` per request: its canvas (its output keyed by position, filled in any
order), frontier, status, counters, sampler and the state its decoder keeps. A row's text is its
committed tokens in position order; it stops at its first stop token once every position before it
is committed, or when its budget of positions is full. Rows join (`join`, prefilled by the caller)
and leave (`leave`) between steps: list operations on `rows`, and calls on the cache
(`fastforward.model.cache.KVCache`).

**Keep** is a per-row choice over a forward's new entries: a count shared by every row, a per-row
count (a prefix), or per row the entries to keep (slot lists or a bool mask). The cache is
rectangular; entries a row does not keep are moved out of the way (a per-row gather, only when some
row keeps a non-prefix) or left as holes that no later query sees.

**Cost.** Right after a forward every small tensor op is slow on a CPU (cold caches: about twice
its cost in a tight loop), so a step is built from few of them. The canvas and counters live on
the host, in the rows, and a step reads its tokens back once; that read-back is the step's one
device sync, which the loop's `finished` check needs anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastforward.decoding.prefill import PREFILL_TOKENS, prefill
from fastforward.decoding.rows import Generation, GenerationInterrupted, Prompt, Row, Stats, Status, make_rows
from fastforward.decoding.sampling import BatchSampler, Sampler
from fastforward.model import Layout, Model, visibility
from fastforward.model.cache import KVCache

__all__ = [
    "PREFILL_TOKENS",
    "Generation",
    "GenerationInterrupted",
    "Prompt",
    "Row",
    "Session",
    "Stats",
    "Status",
    "prefilled",
    "start",
]

KeepChoice = int | Sequence[int] | Sequence[Sequence[int]] | torch.Tensor


def prefilled(
    model: Model,
    prompts: Sequence[Sequence[int] | Prompt],
    max_new_tokens: int | Sequence[int],
    sampler: Sampler | None = None,
    suffix_upfront: bool = True,
) -> tuple[list[Row], KVCache, torch.Tensor]:
    """New rows of `prompts` (each with its budget, one or one per prompt, and `sampler` unless it has
    its own), prefilled: their cache and next-token logits, which a new `Session` or `Session.join`
    takes. suffix_upfront: whether the prefill caches an infilling row's suffix (if not, its decoder
    brings it in)."""
    rows = make_rows(model, prompts, max_new_tokens, sampler or Sampler())
    return (rows, *prefill(model, rows, suffix_upfront))


def start(model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int | Sequence[int]) -> Session:
    """A batch of `prompts` (greedy, suffixes cached up front), prefilled: `Session(model, *prefilled(...))`."""
    return Session(model, *prefilled(model, prompts, max_new_tokens))


class Session:
    """A batch being decoded: its rows and their cache. See the module docstring."""

    def __init__(self, model: Model, rows: list[Row], cache: KVCache, next_logits: torch.Tensor):
        """rows: prefilled into `cache`, with `next_logits` [B, V] after each row's prefix (`prefill`)."""
        self.model = model
        self.device = model.device
        self.rows = rows
        self.cache = cache
        self.next_logits = next_logits  # the prefill's prediction after each row's prefix [B, V]
        self.sampler = BatchSampler(rows, self.device)  # how the rows choose tokens
        # A bound on the tokens one forward runs over all its rows, for decoders that can draft less when
        # many rows share a forward (jacobi, lookup, sbd-verified: `steps.row_tokens`); None: none. The
        # server sets it (`serve --max-step-tokens`).
        self.step_tokens: int | None = None
        self._step: _Step | None = None
        self._reads: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def finished(self) -> bool:
        return all(row.finished for row in self.rows)

    def results(self) -> list[Generation]:
        """Every row's generation so far."""
        return [row.result(self.model.decode) for row in self.rows]

    # ---- the step protocol --------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rule: torch.Tensor | None = None,
        read: range | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run new tokens [B, T] at `positions` under `rule` ([T, T], per row [B, T, T], None =
        causal); every new token also sees the row's valid cache. All T entries enter the cache
        until `advance` says which stay.

        read: the new tokens whose logits are returned (a range or an index tensor), float32
        [B, len(read), V]. The rows still running take part: each gets one forward in its NFE.
        """
        if self._step is not None:
            raise RuntimeError("the previous step is still open: call session.advance(keep) after each forward")
        taking_part = [not row.finished for row in self.rows]
        length = tokens.shape[1]
        for row, part in zip(self.rows, taking_part, strict=True):
            row.forwards += part
            row.queries += part * length
            row.committed = 0
        self._step = _Step(self.cache.get_seq_length(), length, taking_part)
        self.cache.extend_valid(length)
        if isinstance(read, range):
            read = self._read_index(read)
        valid = self.cache.key_valid
        mask = None  # causal over a cache without holes: the model's own path, no dense mask to build or read
        if rule is not None or valid is not None:
            rule = visibility.causal(length, self.device) if rule is None else rule
            mask = visibility.over_cache(rule, self._step.base, valid, self.batch)
        return self.model.run(Layout(tokens, positions, mask, read), self.cache)

    def _read_index(self, read: range) -> torch.Tensor:
        key = (read.start, read.stop)
        if key not in self._reads:
            self._reads[key] = torch.arange(read.start, read.stop, device=self.device)
        return self._reads[key]

    def advance(self, keep: KeepChoice) -> None:
        """Close the step: keep the chosen new entries in the cache and log what the step committed.

        keep: an int (the first `keep` new entries, every row alike); per row, a count of leading
        entries (a list of ints or a long tensor [B]); or per row, the entries to keep (a list of
        ascending slot lists, or a bool tensor [B, T]), kept in order.
        """
        step = self._step
        if step is None:
            raise RuntimeError("no step is open: session.advance follows session.forward")
        if isinstance(keep, int):
            if keep != step.new:
                self.cache.truncate(step.base + keep)
        else:
            if isinstance(keep, torch.Tensor):
                keep = keep.tolist()
                if keep and isinstance(keep[0], list) and keep[0] and isinstance(keep[0][0], bool):
                    keep = [[slot for slot, kept in enumerate(row) if kept] for row in keep]
            self.cache.keep(step.base, self.batch, list(keep))
        for row, took_part in zip(self.rows, step.rows, strict=True):
            if took_part:
                row.steps[row.committed] = row.steps.get(row.committed, 0) + 1
        self._step = None

    # ---- rows joining and leaving (continuous batching) -----------------------------------------
    def join(self, rows: list[Row], cache: KVCache, next_logits: torch.Tensor, drop: Sequence[int] = ()) -> list[int]:
        """Add rows between steps, prefilled on their own into `cache` with `next_logits` (`prefill`), and
        drop the rows `drop`; returns the new rows' indices. Where as many rows are dropped as join (or
        more), the new rows take the dropped rows' places and their cache entries are written over those
        rows' (the other rows' are not copied; any further dropped rows then leave); otherwise the
        staying rows keep their order and the new rows' entries are stacked under theirs in one copy.
        Either way the shorter side is left-padded with entries no query sees. The caller then begins
        the new rows (`Decoder.begin`)."""
        if self._step is not None:
            raise RuntimeError("rows join between steps: call session.advance first")
        drop = sorted(drop)
        slots = drop[: len(rows)]
        if len(drop) >= len(rows) and self.cache.overwrite_rows(slots, cache, self.batch):
            for slot, row in zip(slots, rows, strict=True):
                self.rows[slot] = row
            at = torch.tensor(slots, device=self.device)
            self.next_logits = self.next_logits.index_put((at,), next_logits)
            gone = drop[len(rows) :]
            stay = self._remove(gone) if gone else list(range(self.batch))
            self._changed()
            return [stay.index(slot) for slot in slots]
        stay = self._staying(drop)
        part = (self.cache, self.batch, stay if drop else None)  # nothing dropped: the running rows as they are
        self.cache = KVCache.stack(self.model.hf.config, [part, (cache, len(rows), None)])
        self.rows = [self.rows[row] for row in stay] + rows
        kept = self.next_logits[torch.tensor(stay, device=self.device)] if drop else self.next_logits
        self.next_logits = torch.cat([kept, next_logits])
        self._changed()
        return list(range(len(stay), self.batch))

    def leave(self, rows: Sequence[int]) -> None:
        """Remove rows between steps (finished or cancelled). The cache keeps the other rows' entries;
        entries no remaining row sees are dropped (`KVCache.squeeze`)."""
        if self._step is not None:
            raise RuntimeError("rows leave between steps: call session.advance first")
        self._remove(rows)
        self._changed()

    def _remove(self, rows: Sequence[int]) -> list[int]:
        """The rows `rows` out of the session, cache included; returns the staying rows' old indices."""
        stay = self._staying(rows)
        index = torch.tensor(stay, dtype=torch.long, device=self.device)
        self.cache.select(index)
        self.rows = [self.rows[row] for row in stay]
        self.next_logits = self.next_logits[index]
        return stay

    def _staying(self, gone: Sequence[int]) -> list[int]:
        leaving = set(gone)
        return [row for row in range(self.batch) if row not in leaving]

    def _changed(self) -> None:
        """After rows joined or left: entries no row sees go, and the rows choose tokens anew."""
        self.cache.squeeze(self.batch)
        self.sampler = BatchSampler(self.rows, self.device)


@dataclass
class _Step:
    """The open step: where its entries start in the cache, how many, and who takes part."""

    base: int
    new: int
    rows: list[bool]
