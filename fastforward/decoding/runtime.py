"""A batch being decoded: its rows, one KV cache, one step protocol.

Every decoder drives a `Session` the same way:

    logits = session.forward(tokens, positions, rule, read)   # one layout; its new entries enter the cache
    tokens = session.sample(logits, positions)                # greedy, or sampled with each position's own draw
    session.commit(tokens, at, mask) / session.append(tokens, count)  # tokens onto the output canvas
    session.advance(keep)                                     # which new cache entries stay; closes the step

`forward` counts a forward for every row taking part (NFE) and refuses to run while the previous
step is open; `advance` settles the cache and records, per row, how many tokens the step
committed (the tokens-per-step histogram). So no decoder keeps its own statistics.

`session.rows` holds one `Row` per request (`fastforward.decoding.rows`): its canvas (its output
keyed by position, filled in any order), frontier, stop state, counters, sampler and the state its
decoder keeps. A row's text is its committed tokens in position order; it stops at its first stop
token once every position before it is committed, or when its budget of positions is full. Rows join
(`join`, prefilled on their own) and leave (`leave`) between steps: list operations on `rows`, and
calls on the cache (`fastforward.model.cache.KVCache`).

**Keep** is a per-row choice over a forward's new entries: a count shared by every row, a per-row
count (a prefix), or per row the entries to keep (slot lists or a bool mask). The cache is
rectangular; entries a row does not keep are moved out of the way (a per-row gather, only when some
row keeps a non-prefix) or left as holes that no later query sees.

**Cost.** Right after a forward every small tensor op is slow on a CPU (cold caches: about twice
its cost in a tight loop), so a step is built from few of them. The canvas and counters live on
the host and a commit reads its tokens back once; that read-back is the step's one device sync,
which the loop's `finished` check needs anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastforward.decoding.prefill import PREFILL_TOKENS, prefill
from fastforward.decoding.rows import Generation, GenerationInterrupted, Prompt, Row, Stats, make_rows
from fastforward.decoding.sampling import Sampler, greedy, uniforms
from fastforward.model import Layout, Model, visibility
from fastforward.model.cache import KVCache

__all__ = ["PREFILL_TOKENS", "Generation", "GenerationInterrupted", "Prompt", "Row", "Session", "Stats"]

KeepChoice = int | Sequence[int] | Sequence[Sequence[int]] | torch.Tensor


class Session:
    """A batch being decoded: its rows and their cache. See the module docstring.

    The canvas and the counters live on the host, in the rows: a commit reads its tokens back in one
    transfer, which the step's `finished` check needs anyway, and then every update is a handful of
    Python operations instead of a dozen small tensor kernels. `frontier`, `done` and `next_pos` are
    device copies, built when a decoder asks for them.
    """

    def __init__(
        self,
        model: Model,
        prompts: Sequence[Sequence[int] | Prompt],
        max_new_tokens: int | Sequence[int],
        suffix_upfront: bool = True,
        sampler: Sampler | None = None,
    ):
        start = time.perf_counter()
        self.model = model
        self.device = model.device
        self.sampler = sampler or Sampler()  # how `sample` chooses tokens for rows without their own
        stops = frozenset(model.stop_token_ids)
        self.rows: list[Row] = make_rows(prompts, max_new_tokens, self.sampler, stops, model.max_context)
        # Infilling: whether the prefill put each row's suffix in the cache; if not, the decoder brings it in.
        self.suffix_upfront = suffix_upfront
        self.cache: KVCache
        self.cache, self.next_logits = prefill(model, self.rows, suffix_upfront)  # logits after each prefix [B, V]
        seconds = time.perf_counter() - start
        for row in self.rows:
            row.started, row.prefill_seconds = start, seconds
        # A bound on the tokens one forward runs over all its rows, for decoders that can draft less when
        # many rows share a forward (jacobi, lookup, sbd-verified: `row_tokens`); None: none. The server
        # sets it (`serve --max-step-tokens`).
        self.step_tokens: int | None = None
        self.on_step: Callable[[Session], None] | None = None  # called after every step (e.g. to stream)
        self._step: _Step | None = None
        self._reads: dict[tuple[int, int], torch.Tensor] = {}
        self._mirrors: dict[str, torch.Tensor] = {}  # device copies of host state, until a commit
        self._sampling: tuple[torch.Tensor, list[tuple[Sampler, torch.Tensor | None]]] | None = None

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def max_new_tokens(self) -> int:
        return max((row.limit for row in self.rows), default=0)

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
        self._step = _Step(self.cache.get_seq_length(), length, taking_part, [0] * self.batch)
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
        for row, took_part, k in zip(self.rows, step.rows, step.committed, strict=True):
            if took_part:
                row.steps[k] = row.steps.get(k, 0) + 1
        self._step = None
        if self.on_step is not None:
            self.on_step(self)

    def cancel(self, row: int) -> None:
        """Stop decoding a row (its client left, or its output is complete by other rules): it takes
        part in no further forward and commits nothing more; its finish reason is "cancelled"."""
        self.rows[row].cancel()
        self._mirrors.clear()

    # ---- sampling -----------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens [B, ...] for logits [B, ..., V], the tokens to sit at RoPE `positions` [B, ...]:
        each row greedy, or sampled by its sampler with the row's draw for each position (a
        token's position keys its draw, `fastforward.decoding.sampling`; greedy ignores it).
        Rows of different samplers are sampled group by group, each row as it would be alone."""
        if self._sampling is None:
            self._sampling = self._sampling_plan()
        keys, groups = self._sampling
        if not groups:
            return greedy(logits)
        draws = uniforms(keys, positions)
        if len(groups) == 1 and groups[0][1] is None:  # every row alike
            return groups[0][0].inverse_cdf(logits, draws)
        tokens = greedy(logits)
        for sampler, rows in groups:
            tokens[rows] = sampler.inverse_cdf(logits[rows], draws[rows])
        return tokens

    def _sampling_plan(self) -> tuple[torch.Tensor, list[tuple[Sampler, torch.Tensor | None]]]:
        """Each row's sampling key (its own seed, else its sampler's, hashed with its tokens), and the
        samplers at temperature > 0 with the rows they sample (None: every row)."""
        keys = [row.key for row in self.rows]
        rows_of: dict[tuple[float, float], list[int]] = {}
        for index, row in enumerate(self.rows):
            if row.sampler.temperature > 0:
                rows_of.setdefault((row.sampler.temperature, row.sampler.top_p), []).append(index)
        groups: list[tuple[Sampler, torch.Tensor | None]]
        if len(rows_of) == 1 and len(next(iter(rows_of.values()))) == self.batch:
            groups = [(self.rows[0].sampler, None)]
        else:
            groups = [(self.rows[rows[0]].sampler, torch.tensor(rows, device=self.device)) for rows in rows_of.values()]
        return torch.tensor(keys, device=self.device), groups

    # ---- the canvas ---------------------------------------------------------------------------
    def commit(self, tokens: torch.Tensor, at: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Write tokens [B, k] at canvas positions `at` [B, k] where `mask` (default: all) holds.

        Finished rows and positions past a row's budget are left alone. One read-back of the
        tokens, then host updates of each row's canvas, frontier, first stop and done.
        """
        k = tokens.shape[1]
        parts = [tokens, at] if mask is None else [tokens, at, mask.long()]
        for index, values in enumerate(torch.cat(parts, dim=1).tolist()):
            chosen = values[2 * k :] if mask is not None else [1] * k
            self._write(index, [(a, t) for t, a, m in zip(values[:k], values[k : 2 * k], chosen, strict=True) if m])
        self._mirrors.clear()

    def commit_next_tokens(self, rows: Sequence[int]) -> list[int]:
        """Sample the rows `rows` (just prefilled or joined) their first token from the prefill's
        next-token logits and commit it; returns every row's sample (a pure function of the row, so
        the other rows' are the same as theirs were)."""
        first = self.sample(self.next_logits, self.next_pos).tolist()
        starting = set(rows)
        self.append([[t] for t in first], [int(row in starting) for row in range(self.batch)])
        return first

    def append(
        self, tokens: torch.Tensor | Sequence[Sequence[int]], count: torch.Tensor | Sequence[int] | None = None
    ) -> None:
        """Commit the first `count[r]` (default: all) of tokens [B, k] at each row's frontier.

        Tokens and counts may be device tensors (read back here, once) or host lists.
        """
        if isinstance(tokens, torch.Tensor):
            if isinstance(count, torch.Tensor):
                values = torch.cat([tokens, count[:, None]], dim=1).tolist()
                tokens, count = [v[:-1] for v in values], [v[-1] for v in values]
            else:
                tokens = tokens.tolist()
        for index, (row, line) in enumerate(zip(self.rows, tokens, strict=True)):
            n = len(line) if count is None else count[index]
            self._write(index, list(enumerate(line[:n], row.frontier)))
        self._mirrors.clear()

    def _write(self, index: int, writes: list[tuple[int, int]]) -> None:
        written = self.rows[index].write(writes)
        if self._step is not None:
            self._step.committed[index] += written

    def _mirror(self, name: str, values: Callable[[], list]) -> torch.Tensor:
        if name not in self._mirrors:
            self._mirrors[name] = torch.tensor(values(), device=self.device)
        return self._mirrors[name]

    @property
    def frontier(self) -> torch.Tensor:
        """Each row's leading committed positions [B], on the device (built when asked for)."""
        return self._mirror("frontier", lambda: [row.frontier for row in self.rows])

    @property
    def done(self) -> torch.Tensor:
        """Which rows have finished [B], on the device (built when asked for)."""
        return self._mirror("done", lambda: [row.finished for row in self.rows])

    @property
    def next_pos(self) -> torch.Tensor:
        """Each row's RoPE position of its first uncommitted canvas position [B]."""
        return self._mirror("next_pos", lambda: [row.origin + row.frontier for row in self.rows])

    @property
    def lengths(self) -> list[int]:
        """Each row's output length so far: its leading committed positions, up to its stop token."""
        return [row.length for row in self.rows]

    @property
    def nfe(self) -> torch.Tensor:
        """Decoding forwards each row took part in [B]."""
        return torch.tensor([row.forwards for row in self.rows])

    def span(self, start: int, length: int) -> torch.Tensor:
        """RoPE positions [B, length] from `start` positions past each row's frontier (start -1: the
        last committed token), built on the host in one transfer."""
        firsts = [row.origin + row.frontier + start for row in self.rows]
        return torch.tensor([list(range(p, p + length)) for p in firsts], device=self.device)

    def row_tokens(self) -> int | None:
        """The tokens each running row may put in a forward under `step_tokens` (None: no bound)."""
        if self.step_tokens is None:
            return None
        return self.step_tokens // max(1, sum(not row.finished for row in self.rows))

    @property
    def finished(self) -> bool:
        return all(row.finished for row in self.rows)

    @property
    def outputs(self) -> list[list[int]]:
        """Each row's output so far: committed tokens in position order, up to its stop token."""
        return [row.output for row in self.rows]

    def histograms(self) -> list[dict[int, int]]:
        """Per row: how many of its steps committed k tokens, for each k (steps it took part in)."""
        return [dict(row.steps) for row in self.rows]

    def results(self) -> list[Generation]:
        return [self.result(index) for index in range(self.batch)]

    def result(self, index: int) -> Generation:
        row = self.rows[index]
        ids = row.output
        stats = row.stats(time.perf_counter() - row.started)
        return Generation(ids, self.model.decode(ids), stats, row.finish_reason)

    def finish_reason(self, index: int) -> str:
        """Why a row ended (see `Generation`); "interrupted" while it has not."""
        return self.rows[index].finish_reason

    # ---- rows joining and leaving (continuous batching) -----------------------------------------
    def join(
        self, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int | Sequence[int], drop: Sequence[int] = ()
    ) -> list[int]:
        """Add rows between steps (and drop the rows `drop`, whose generations the caller has read with
        `result`); returns the new rows' indices. The new rows are prefilled on their own, as a session
        of them would be. Where as many rows are dropped as join (or more), the new rows take the
        dropped rows' places and their cache entries are written over those rows' (the other rows' are
        not copied; any further dropped rows then leave); otherwise the staying rows keep their order
        and the new rows' entries are stacked under theirs in one copy. Either way the shorter side is
        left-padded with entries no query sees. The new rows' `next_logits` are set; the caller then
        begins them (`Decoder.begin`). max_new_tokens: one budget, or one per prompt."""
        if self._step is not None:
            raise RuntimeError("rows join between steps: call session.advance first")
        new = Session(self.model, prompts, max_new_tokens, self.suffix_upfront, self.sampler)
        drop = sorted(drop)
        slots = drop[: new.batch]
        if len(drop) >= new.batch and self.cache.overwrite_rows(slots, new.cache, self.batch):
            for slot, row in zip(slots, new.rows, strict=True):
                self.rows[slot] = row
            at = torch.tensor(slots, device=self.device)
            self.next_logits = self.next_logits.index_put((at,), new.next_logits)
            gone = drop[new.batch :]
            stay = self._remove(gone) if gone else list(range(self.batch))
            self._changed()
            return [stay.index(slot) for slot in slots]
        stay = self._staying(drop)
        part = (self.cache, self.batch, stay if drop else None)  # nothing dropped: the running rows as they are
        self.cache = KVCache.stack(self.model.hf.config, [part, (new.cache, new.batch, None)])
        self.rows = [self.rows[row] for row in stay] + new.rows
        kept = self.next_logits[torch.tensor(stay, device=self.device)] if drop else self.next_logits
        self.next_logits = torch.cat([kept, new.next_logits])
        self._changed()
        return list(range(len(stay), self.batch))

    def leave(self, rows: Sequence[int]) -> list[Generation]:
        """Remove rows between steps (finished or cancelled), returning their generations. The cache
        keeps the other rows' entries; entries no remaining row sees are dropped (`KVCache.squeeze`)."""
        if self._step is not None:
            raise RuntimeError("rows leave between steps: call session.advance first")
        results = [self.result(row) for row in rows]
        self._remove(rows)
        self._changed()
        return results

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
        """After rows joined or left: entries no row sees go, and the device copies are stale."""
        self.cache.squeeze(self.batch)
        self._sampling = None
        self._mirrors.clear()


@dataclass
class _Step:
    """The open step: where its entries start in the cache, how many, who takes part, what it committed."""

    base: int
    new: int
    rows: list[bool]
    committed: list[int]
