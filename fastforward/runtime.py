"""A batch being decoded: one KV cache, an output canvas per row, segment prefill, one step protocol.

Every decoder drives a `Session` the same way:

    logits = session.forward(tokens, positions, rule, read)   # one layout; its new entries enter the cache
    session.commit(tokens, at, mask) / session.append(tokens, count)  # tokens onto the output canvas
    session.advance(keep)                                     # which new cache entries stay; closes the step

`forward` counts a forward for every row taking part (NFE) and refuses to run while the previous
step is open; `advance` settles the cache and records, per row, how many tokens the step
committed (the tokens-per-step histogram). So no decoder keeps its own statistics.

The **canvas** holds a row's output keyed by position (index 0 is the first position after the
prefix): tokens may be committed anywhere, in any order. A row's text is its committed tokens in
position order; it stops at its first stop token once every position before it is committed, or
when its budget of positions is full.

**Prefill** takes segments with their own positions: a prompt, or for infilling a prefix and a
suffix with a gap between them. The cache afterwards equals a causal prefill of the same tokens in
the same order. **Keep** is a per-row choice over a forward's new entries: a count shared by every
row, a per-row count (a prefix), or a per-row boolean mask. The cache is rectangular; entries a row
does not keep are moved out of the way (a per-row gather, only when some row keeps a non-prefix)
or left as holes that no later query sees.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastforward import visibility
from fastforward.cache import gather_entries, truncate
from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model


@dataclass
class Stats:
    """Per-prompt decoding figures. NFE counts decoding forwards only (prefill is separate)."""

    nfe: int
    tokens: int
    seconds: float
    prefill_seconds: float
    tokens_per_step: dict[int, int] = field(default_factory=dict)

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else float(self.tokens)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "nfe": self.nfe,
            "tokens": self.tokens,
            "tpf": round(self.tpf, 4),
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "tps": round(self.tps, 3),
            "tokens_per_step": {str(k): v for k, v in sorted(self.tokens_per_step.items())},
        }


@dataclass
class Generation:
    """One prompt's output: generated ids (prompt excluded, stop token included), text, stats."""

    token_ids: list[int]
    text: str
    stats: Stats


@dataclass(frozen=True)
class Prompt:
    """What one row is decoded from: a prefix, and for infilling a suffix `gap` positions after it.

    Without a suffix the row generates up to max_new_tokens after the prefix. With one, the row
    fills exactly the `gap` positions between them (its canvas), and the suffix is in the cache
    from the start, at its true positions.
    """

    prefix: Sequence[int]
    suffix: Sequence[int] = ()
    gap: int = 0

    def __post_init__(self) -> None:
        if not self.prefix:
            raise FastForwardError("a prompt is empty; give at least one token")
        if self.suffix and self.gap <= 0:
            raise FastForwardError(f"an infilling prompt needs a gap of at least 1 position, got {self.gap}")


KeepChoice = int | torch.Tensor


class Session:
    """A batch being decoded: cache, key validity, canvas, counters. See the module docstring."""

    def __init__(self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int):
        if not prompts:
            raise FastForwardError("no prompts given")
        if max_new_tokens <= 0:
            raise FastForwardError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        rows = [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]
        context = model.max_context
        longest = max(len(p.prefix) + p.gap + len(p.suffix) for p in rows)
        if context is not None and longest >= context:
            raise FastForwardError(
                f"a prompt has {longest} tokens but the model's context is {context}; shorten the prompt"
            )
        self.model = model
        self.device = device = model.device
        self.batch = len(rows)
        # Each row's budget of canvas positions: the gap when infilling, else max_new_tokens (and the context).
        limits = [
            p.gap if p.suffix else min(max_new_tokens, context - len(p.prefix) if context else max_new_tokens)
            for p in rows
        ]
        self.max_new_tokens = max(limits)
        self.limit = torch.tensor(limits, device=device)
        self.origin = torch.tensor([len(p.prefix) for p in rows], device=device)
        self.stop_ids = torch.tensor(model.stop_token_ids or [-1], device=device)
        width = self.max_new_tokens
        # One spare column takes writes past a row's budget, so a scatter never collides.
        self.canvas = torch.full((self.batch, width + 1), model.pad_token_id, dtype=torch.long, device=device)
        self.filled = torch.zeros(self.batch, width + 1, dtype=torch.bool, device=device)
        self.frontier = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.length = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.done = torch.zeros(self.batch, dtype=torch.bool, device=device)
        self.nfe = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.histogram = torch.zeros(self.batch, width + 2, dtype=torch.long, device=device)
        self._columns = torch.arange(width + 1, device=device)
        self._step: _Step | None = None
        self.cache = model.new_cache()
        self.start = time.perf_counter()
        self.next_logits = self._prefill(rows)
        self.prefill_seconds = time.perf_counter() - self.start

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill(self, rows: list[Prompt]) -> torch.Tensor:
        """Left-padded causal prefill of each row's segments; returns the logits after each prefix [B, V]."""
        tokens = [[*p.prefix, *p.suffix] for p in rows]
        positions = [
            [*range(len(p.prefix)), *range(len(p.prefix) + p.gap, p.gap + len(t))]
            for p, t in zip(rows, tokens, strict=True)
        ]
        width = max(len(t) for t in tokens)
        pads = [width - len(t) for t in tokens]
        pad_id = self.model.pad_token_id
        ids = torch.tensor([[pad_id] * n + t for n, t in zip(pads, tokens, strict=True)], device=self.device)
        pos = torch.tensor([[0] * n + q for n, q in zip(pads, positions, strict=True)], device=self.device)
        self.key_valid = (
            torch.arange(width, device=self.device)[None] >= torch.tensor(pads, device=self.device)[:, None]
        )
        self.padded = any(pads)
        # Read where each prefix ends; rows with suffixes of different lengths read different slots.
        ends = [width - len(p.suffix) - 1 for p in rows]
        read = sorted(set(ends))
        logits = self._run(ids, pos, None, read)
        pick = torch.tensor([read.index(e) for e in ends], device=self.device)
        return logits[torch.arange(self.batch, device=self.device), pick]

    # ---- the step protocol --------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rule: torch.Tensor | None = None,
        read: Sequence[int] | torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        new_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run new tokens [B, T] at `positions` under `rule` ([T, T], None = causal); every new token
        also sees the row's valid cache. All T entries enter the cache until `advance` says which stay.

        rows: the rows taking part (default: those still running); each gets one forward in NFE.
        new_valid [B, T] marks padding among the new tokens. Returns float32 logits [B, len(read), V].
        """
        if self._step is not None:
            raise RuntimeError("the previous step is still open: call session.advance(keep) after each forward")
        rows = ~self.done if rows is None else rows
        self.nfe += rows.long()
        length = tokens.shape[1]
        self._step = _Step(
            base=self.cache.get_seq_length(), new=length, rows=rows, committed=torch.zeros_like(self.nfe)
        )
        if new_valid is None:
            new_valid = torch.ones(self.batch, length, dtype=torch.bool, device=self.device)
        self.key_valid = torch.cat([self.key_valid, new_valid], dim=1)
        return self._run(tokens, positions, rule, read)

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rule: torch.Tensor | None,
        read: Sequence[int] | torch.Tensor | None,
    ) -> torch.Tensor:
        """Run new tokens against the cache; `self.key_valid` already covers them."""
        if rule is None and not self.padded:
            mask = None  # the model's own causal path: no dense mask to build or read
        else:
            rule = visibility.causal(tokens.shape[1], self.device) if rule is None else rule
            mask = visibility.against_cache(rule, self.key_valid)
        if read is not None and not isinstance(read, torch.Tensor):
            read = torch.tensor(read, dtype=torch.long, device=self.device)
        return self.model.run(Layout(tokens, positions, mask, read, keep=tokens.shape[1]), self.cache)

    def advance(self, keep: KeepChoice) -> None:
        """Close the step: keep the chosen new entries in the cache and record what the step committed.

        keep: an int (the first `keep` new entries, every row alike), a long tensor [B] (a per-row
        prefix count) or a bool tensor [B, T] (a per-row choice of new entries, kept in order).
        """
        step = self._step
        if step is None:
            raise RuntimeError("no step is open: session.advance follows session.forward")
        self._keep(step, keep)
        counts = step.committed.clamp_max(self.histogram.shape[1] - 1)
        self.histogram[torch.arange(self.batch, device=self.device), counts] += step.rows.long()
        self._step = None

    def _keep(self, step: _Step, keep: KeepChoice) -> None:
        base, new = step.base, step.new
        if isinstance(keep, int):
            truncate(self.cache, base + keep)
            self.key_valid = self.key_valid[:, : base + keep]
            return
        if keep.dtype == torch.bool:
            counts = keep.sum(-1)
            order = (~keep).to(torch.uint8).argsort(dim=-1, stable=True)  # kept entries first, in order
            slots = torch.arange(new, device=self.device)[None]
            in_place = (order == slots) | (slots >= counts[:, None])
            low, high, prefix = torch.stack([counts.min(), counts.max(), in_place.all().long()]).tolist()
            if not prefix:
                gather_entries(self.cache, base, order[:, :high])
        else:
            counts = keep
            low, high = torch.stack([counts.min(), counts.max()]).tolist()
        truncate(self.cache, base + high)
        kept = torch.arange(high, device=self.device)[None] < counts[:, None]
        self.key_valid = torch.cat([self.key_valid[:, :base], kept & self.key_valid[:, base : base + high]], dim=1)
        if low < high:
            self.padded = True  # rows differ: the shorter ones hold holes from now on

    # ---- the canvas ---------------------------------------------------------------------------
    def commit(self, tokens: torch.Tensor, at: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Write tokens [B, k] at canvas positions `at` [B, k] where `mask` (default: all) holds.

        Finished rows and positions past a row's budget are left alone. Updates each row's
        frontier (leading committed positions), output length and `done`.
        """
        allowed = ~self.done[:, None] & (at < self.limit[:, None])
        mask = allowed if mask is None else mask & allowed
        spare = self.canvas.shape[1] - 1
        at = torch.where(mask, at, spare)
        self.canvas.scatter_(1, at, torch.where(mask, tokens, self.canvas.gather(1, at)))
        self.filled.scatter_(1, at, mask | self.filled.gather(1, at))
        if self._step is not None:
            self._step.committed += mask.sum(-1)
        self._settle()

    def append(self, tokens: torch.Tensor, count: torch.Tensor | None = None) -> None:
        """Commit the first `count[r]` (default: all) of tokens [B, k] at each row's frontier."""
        offsets = torch.arange(tokens.shape[1], device=self.device)[None]
        mask = None if count is None else offsets < count[:, None]
        self.commit(tokens, self.frontier[:, None] + offsets, mask)

    def _settle(self) -> None:
        """Frontier, output length and `done` from the canvas (tensor ops, no host sync)."""
        filled = self.filled[:, :-1]
        self.frontier = filled.long().cumprod(-1).sum(-1)
        stop = torch.isin(self.canvas[:, :-1], self.stop_ids) & filled
        first_stop = torch.where(stop.any(-1), stop.long().argmax(-1), self.max_new_tokens)
        self.length = torch.minimum(self.frontier, first_stop + 1)
        self.done |= (first_stop < self.frontier) | (self.frontier >= self.limit)

    @property
    def next_pos(self) -> torch.Tensor:
        """Each row's RoPE position of its first uncommitted canvas position [B]."""
        return self.origin + self.frontier

    @property
    def produced(self) -> int:
        """The most leading positions committed by a row still running (0 when none runs)."""
        return int(torch.where(self.done, 0, self.frontier).max())

    @property
    def finished(self) -> bool:
        return bool(self.done.all())

    @property
    def outputs(self) -> list[list[int]]:
        """Each row's output so far: committed tokens in position order, up to its stop token."""
        canvas, lengths = self.canvas.tolist(), self.length.tolist()
        return [row[:n] for row, n in zip(canvas, lengths, strict=True)]

    def results(self) -> list[Generation]:
        seconds = time.perf_counter() - self.start
        nfe, histogram = self.nfe.tolist(), self.histogram.tolist()
        out = []
        for row, ids in enumerate(self.outputs):
            steps = {k: v for k, v in enumerate(histogram[row]) if v}
            stats = Stats(nfe[row], len(ids), seconds, self.prefill_seconds, steps)
            out.append(Generation(ids, self.model.decode(ids), stats))
        return out


@dataclass
class _Step:
    """The open step: where its entries start in the cache, how many, who takes part, what it committed."""

    base: int
    new: int
    rows: torch.Tensor
    committed: torch.Tensor
