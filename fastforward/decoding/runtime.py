"""A batch being decoded: one KV cache, an output canvas per row, segment prefill, one step protocol.

Every decoder drives a `Session` the same way:

    logits = session.forward(tokens, positions, rule, read)   # one layout; its new entries enter the cache
    tokens = session.sample(logits, positions)                # greedy, or sampled with each position's own draw
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
row, a per-row count (a prefix), or per row the entries to keep (slot lists or a bool mask). The
cache is rectangular; entries a row does not keep are moved out of the way (a per-row gather, only
when some row keeps a non-prefix) or left as holes that no later query sees.

**Cost.** Right after a forward every small tensor op is slow on a CPU (cold caches: about twice
its cost in a tight loop), so a step is built from few of them. The canvas and counters live on
the host and a commit reads its tokens back once; that read-back is the step's one device sync,
which the loop's `finished` check needs anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fastforward.cpu import padded_prefill
from fastforward.decoding import metrics
from fastforward.decoding.sampling import Sampler, greedy, row_key, uniforms
from fastforward.errors import FastForwardError
from fastforward.model import Layout, Model, visibility
from fastforward.model.cache import drop_leading, gather_entries, overwrite_rows, repack, stack_rows, truncate

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class Stats:
    """Per-prompt decoding figures. NFE counts decoding forwards only (prefill is separate).

    queries: the tokens those forwards ran through the model (AR: one per forward; drafts,
    candidates and masked positions add theirs). On a CPU a forward's cost grows with them, so
    queries per generated token says what a decoder's tokens per forward cost: just under 1.0 for
    AR, whose first token comes from the prefill."""

    nfe: int
    tokens: int
    seconds: float
    prefill_seconds: float
    tokens_per_step: dict[int, int] = field(default_factory=dict)
    queries: int = 0

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else float(self.tokens)

    @property
    def queries_per_token(self) -> float:
        return metrics.queries_per_token(self.queries, self.tokens)

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
            "queries": self.queries,
            "queries_per_token": round(self.queries_per_token, 4),
            "tokens_per_step": {str(k): v for k, v in sorted(self.tokens_per_step.items())},
        }


@dataclass
class Generation:
    """One prompt's output: generated ids (prompt excluded, stop token included), text, stats, and
    why it ended: "stop" (a stop token), "length" (max_new_tokens, or an infilling gap filled),
    "context" (the model's context had no room for max_new_tokens after this prompt) or "cancelled"
    (`Session.cancel`)."""

    token_ids: list[int]
    text: str
    stats: Stats
    finish_reason: str = "length"


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during decoding, carrying what each row had committed by then (finish_reason
    "interrupted" for the rows still running)."""

    def __init__(self, generations: list[Generation]):
        super().__init__()
        self.generations = generations


@dataclass(frozen=True)
class Prompt:
    """What one row is decoded from: a prefix, and for infilling a suffix `gap` positions after it.

    Without a suffix the row generates up to max_new_tokens after the prefix. With one, the row
    fills exactly the `gap` positions between them (its canvas), and the suffix is in the cache
    from the start, at its true positions. seed: the row's own sampling seed (None: its sampler's),
    so rows of one batch can be sampled apart (a request's seed, or many samples of one prompt).
    sampler: the row's own temperature and top-p (None: the session's), so requests that differ in
    them share a batch. ignore_eos: the row decodes through stop tokens up to its budget (a server
    request's `ignore_eos`, as benchmark clients send to fix output lengths).
    """

    prefix: Sequence[int]
    suffix: Sequence[int] = ()
    gap: int = 0
    seed: int | None = None
    sampler: Sampler | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.prefix:
            raise FastForwardError("a prompt is empty; give at least one token")
        if self.suffix and self.gap <= 0:
            raise FastForwardError(f"an infilling prompt needs a gap of at least 1 position, got {self.gap}")


KeepChoice = int | Sequence[int] | Sequence[Sequence[int]] | torch.Tensor


# Padded prompt tokens one prefill forward runs at most (more prefill in several: `prefill_chunks`).
PREFILL_TOKENS = 2048


def prefill_chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The prompts (by their lengths) to prefill together: indices in groups of similar length, each
    at most `budget` padded tokens (a longer prompt alone) with its longest prompt at most twice its
    shortest plus 8, so that padding at most about doubles a group's work. All in one group, in their
    order, when they fit (the usual case: a prompt alone, or a batch of similar ones)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    chunks = [[order[0]]]
    for index in order[1:]:
        chunk = chunks[-1]  # ascending: `index` is its longest prompt, chunk[0] its shortest
        if (len(chunk) + 1) * lengths[index] <= budget and lengths[index] <= 2 * lengths[chunk[0]] + 8:
            chunk.append(index)
        else:
            chunks.append([index])
    return [list(range(len(lengths)))] if len(chunks) == 1 else chunks


def validity(key_valid: torch.Tensor | None, rows: int, entries: int, device: torch.device) -> torch.Tensor:
    """A cache's key validity [rows, entries]: `key_valid`, or all real where it is None (untracked)."""
    if key_valid is not None:
        return key_valid
    return torch.ones(rows, entries, dtype=torch.bool, device=device)


class Session:
    """A batch being decoded: cache, key validity, canvas, counters. See the module docstring.

    The canvas and the counters live on the host (Python lists): a commit reads its tokens back
    in one transfer, which the step's `finished` check needs anyway, and then every update is a
    handful of Python operations instead of a dozen small tensor kernels. `frontier` and `done`
    are device copies, built when a decoder asks for them.
    """

    def __init__(
        self,
        model: Model,
        prompts: Sequence[Sequence[int] | Prompt],
        max_new_tokens: int | Sequence[int],
        suffix_upfront: bool = True,
        sampler: Sampler | None = None,
    ):
        self.start = time.perf_counter()
        if not prompts:
            raise FastForwardError("no prompts given")
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != len(prompts) or min(budgets) <= 0:
            raise FastForwardError(f"max_new_tokens must be > 0 (one, or one per prompt), got {max_new_tokens}")
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
        # Each row's own budget of canvas positions: the gap when infilling, else max_new_tokens, or
        # less where the model's context has no room for that many after this row's prompt.
        self.limits = [
            p.gap if p.suffix else min(budget, (context or 10**9) - len(p.prefix))
            for p, budget in zip(rows, budgets, strict=True)
        ]
        self.context_bound = [
            not p.suffix and limit < budget for p, limit, budget in zip(rows, self.limits, budgets, strict=True)
        ]
        self.max_new_tokens = max(self.limits)
        self.prefixes = [list(p.prefix) for p in rows]  # each row's prompt (drafts may be looked up in it)
        self.origins = [len(p.prefix) for p in rows]  # the RoPE position of each row's canvas position 0
        # Infilling: each row's suffix (it follows canvas position `limit - 1`) and whether the prefill
        # put it in the cache; if not, the decoder brings it in (`Prompt` says where it goes).
        self.suffixes = [list(p.suffix) for p in rows]
        self.suffix_upfront = suffix_upfront
        self.sampler = sampler or Sampler()  # how `sample` chooses tokens for rows without their own
        self.samplers = [p.sampler or self.sampler for p in rows]
        self.seeds = [p.seed for p in rows]
        self._sampling_keys: torch.Tensor | None = None
        self._sampling_groups: list[tuple[Sampler, torch.Tensor | None]] | None = None
        self.origin = torch.tensor(self.origins, device=device)
        self.stop_ids = torch.tensor(model.stop_token_ids or [-1], device=device)
        stops = frozenset(model.stop_token_ids)
        self.stop_sets = [frozenset() if p.ignore_eos else stops for p in rows]  # each row's stop tokens
        # Host state per row: the canvas (None = not committed), leading committed positions, the
        # position of the first committed stop token (the budget if none), done, forwards taken part in.
        self.canvas: list[list[int | None]] = [[None] * n for n in self.limits]
        self.frontiers = [0] * self.batch
        self.first_stops = list(self.limits)
        self.finished_rows = [False] * self.batch
        self.forwards = [0] * self.batch
        self.queries = [0] * self.batch  # tokens run by the forwards each row took part in
        self.steps: list[dict[int, int]] = [{} for _ in rows]  # per row: steps that committed k tokens, by k
        self.row_state: dict[str, list] = {}  # a decoder's per-row lists (`per_row`), kept in step by join/leave
        # A bound on the tokens one forward runs over all its rows, for decoders that can draft less when
        # many rows share a forward (jacobi, lookup, sbd-verified: `row_tokens`); None: none. The server
        # sets it (`serve --max-step-tokens`).
        self.step_tokens: int | None = None
        self._reads: dict[tuple[int, int], torch.Tensor] = {}
        self._step: _Step | None = None
        self._mirrors: dict[str, torch.Tensor] = {}
        self._cancelled: set[int] = set()
        self.on_step: Callable[[Session], None] | None = None  # called after every step (e.g. to stream)
        self.next_logits = self._prefill(rows)
        self.prefill_seconds = time.perf_counter() - self.start
        self.started = [self.start] * self.batch  # when each row's request began (rows may join later)
        self.prefill_times = [self.prefill_seconds] * self.batch

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill(self, rows: list[Prompt]) -> torch.Tensor:
        """Left-padded causal prefill of each row's segments (sets the cache and key validity); returns
        the logits after each prefix [B, V].

        Prompts of very different lengths, or more prompt tokens than `PREFILL_TOKENS`, prefill in
        several forwards (`prefill_chunks`), whose caches are then stacked: padding a 6-token prompt
        to a 400-token one costs as much as the long one, and on a CPU a token costs more in a very
        large forward (`benchmarks/prefill_chunks.py`). Under `--exact` a row's entries and logits
        do not depend on the rows it shares a forward with, so chunks change only the time; without
        it they may round differently, as in any batch."""
        tokens = [[*p.prefix, *(p.suffix if self.suffix_upfront else ())] for p in rows]
        chunks = prefill_chunks([len(t) for t in tokens], PREFILL_TOKENS)
        if len(chunks) == 1:
            self.cache, self.key_valid, logits = self._prefill_forward(rows, tokens)
            return logits
        parts = [self._prefill_forward([rows[i] for i in c], [tokens[i] for i in c]) for c in chunks]
        widths = [cache.get_seq_length() for cache, _, _ in parts]
        width = max(widths)
        pads = [width - w for w in widths]
        cache = stack_rows(self.model.hf.config, [cache for cache, _, _ in parts], pads)
        valid = [
            F.pad(validity(v, len(c), w, self.device), (pad, 0))
            for (_, v, _), c, w, pad in zip(parts, chunks, widths, pads, strict=True)
        ]
        order = torch.tensor([i for c in chunks for i in c], device=self.device).argsort()  # back to row order
        cache.batch_select_indices(order)
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[order]
        self.cache, self.key_valid = cache, torch.cat(valid)[order]
        return torch.cat([logits for _, _, logits in parts])[order]

    def _prefill_forward(
        self, rows: list[Prompt], tokens: list[list[int]]
    ) -> tuple[DynamicCache, torch.Tensor | None, torch.Tensor]:
        """One left-padded forward over `rows` (their `tokens`, suffixes included) into a new cache:
        the cache, its key validity [B, W] (None: no padding) and each row's logits after its prefix."""
        positions = [
            [*range(len(p.prefix)), *range(len(p.prefix) + p.gap, len(t) + p.gap)]
            for p, t in zip(rows, tokens, strict=True)
        ]
        width = max(len(t) for t in tokens)
        pads = [width - len(t) for t in tokens]
        pad_id = self.model.pad_token_id
        ids = torch.tensor([[pad_id] * n + t for n, t in zip(pads, tokens, strict=True)], device=self.device)
        pos = torch.tensor([[0] * n + q for n, q in zip(pads, positions, strict=True)], device=self.device)
        # key_valid [B, P] marks real cache entries; None while every entry is real (no padding, no holes).
        key_valid: torch.Tensor | None = None
        mask = None  # the model's own causal path: no dense mask to build or read
        if any(pads):
            pad_counts = torch.tensor(pads, device=self.device)[:, None]
            key_valid = torch.arange(width, device=self.device)[None] >= pad_counts
            mask = visibility.against_cache(visibility.causal(width, self.device), key_valid)
        # Read where each prefix ends; rows with suffixes of different lengths read different slots.
        ends = [width - len(t) + len(p.prefix) - 1 for p, t in zip(rows, tokens, strict=True)]
        read = sorted(set(ends))
        reads = torch.tensor(read, device=self.device)
        cache = self.model.new_cache()
        if self.model.batch_invariant and len(rows) > 1:
            # Each row's attention alone, from its first token, under a one-prompt prefill's mask: its
            # entries and logits are a one-prompt prefill's bits (`padded_prefill`), padded or not.
            with padded_prefill.rows_apart(pads):
                logits = self.model.run(Layout(ids, pos, None, reads, keep=width), cache)
        else:
            logits = self.model.run(Layout(ids, pos, mask, reads, keep=width), cache)
        pick = torch.tensor([read.index(e) for e in ends], device=self.device)
        return cache, key_valid, logits[torch.arange(len(rows), device=self.device), pick]

    # ---- the step protocol --------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rule: torch.Tensor | None = None,
        read: range | torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run new tokens [B, T] at `positions` under `rule` ([T, T], per row [B, T, T], None =
        causal); every new token also sees the row's valid cache. All T entries enter the cache
        until `advance` says which stay.

        read: the new tokens whose logits are returned (a range or an index tensor), float32
        [B, len(read), V]. rows: the rows taking part (a bool tensor [B]; default: those still
        running); each of them gets one forward in its NFE.
        """
        if self._step is not None:
            raise RuntimeError("the previous step is still open: call session.advance(keep) after each forward")
        taking_part = [not d for d in self.finished_rows] if rows is None else rows.tolist()
        length = tokens.shape[1]
        for row, part in enumerate(taking_part):
            self.forwards[row] += part
            self.queries[row] += part * length
        self._step = _Step(self.cache.get_seq_length(), length, taking_part, [0] * self.batch)
        if self.key_valid is not None:
            fresh = torch.ones(self.batch, length, dtype=torch.bool, device=self.device)
            self.key_valid = torch.cat([self.key_valid, fresh], dim=1)
        if isinstance(read, range):
            read = self._read_index(read)
        return self._run(tokens, positions, rule, read)

    def _read_index(self, read: range) -> torch.Tensor:
        key = (read.start, read.stop)
        if key not in self._reads:
            self._reads[key] = torch.arange(read.start, read.stop, device=self.device)
        return self._reads[key]

    def _run(
        self, tokens: torch.Tensor, positions: torch.Tensor, rule: torch.Tensor | None, read: torch.Tensor | None
    ) -> torch.Tensor:
        """Run new tokens against the cache; `self.key_valid` (when set) already covers them."""
        length = tokens.shape[1]
        if self.key_valid is not None:
            rule = visibility.causal(length, self.device) if rule is None else rule
            mask = visibility.against_cache(rule, self.key_valid)
        elif rule is not None:
            mask = visibility.after_full_cache(rule, self.cache.get_seq_length())
            mask = mask.expand(self.batch, -1, -1) if mask.dim() == 2 else mask
        else:
            mask = None  # the model's own causal path: no dense mask to build or read
        return self.model.run(Layout(tokens, positions, mask, read, keep=length), self.cache)

    def advance(self, keep: KeepChoice) -> None:
        """Close the step: keep the chosen new entries in the cache and log what the step committed.

        keep: an int (the first `keep` new entries, every row alike); per row, a count of leading
        entries (a list of ints or a long tensor [B]); or per row, the entries to keep (a list of
        ascending slot lists, or a bool tensor [B, T]), kept in order.
        """
        step = self._step
        if step is None:
            raise RuntimeError("no step is open: session.advance follows session.forward")
        if not (isinstance(keep, int) and keep == step.new):
            self._keep(step, keep)
        for row, (took_part, k) in enumerate(zip(step.rows, step.committed, strict=True)):
            if took_part:
                self.steps[row][k] = self.steps[row].get(k, 0) + 1
        self._step = None
        if self.on_step is not None:
            self.on_step(self)

    def cancel(self, row: int) -> None:
        """Stop decoding a row (its client left, or its output is complete by other rules): it takes
        part in no further forward and commits nothing more; its finish reason is "cancelled"."""
        if not self.finished_rows[row]:
            self.finished_rows[row] = True
            self._cancelled.add(row)
            self._mirrors.clear()

    def _keep(self, step: _Step, keep: KeepChoice) -> None:
        base, new = step.base, step.new
        if isinstance(keep, int):
            truncate(self.cache, base + keep)
            if self.key_valid is not None:
                self.key_valid = self.key_valid[:, : base + keep]
            return
        if isinstance(keep, torch.Tensor):
            keep = keep.tolist()
            if keep and isinstance(keep[0], list) and keep[0] and isinstance(keep[0][0], bool):
                keep = [[slot for slot, kept in enumerate(row) if kept] for row in keep]
        if keep and isinstance(keep[0], list):  # slot lists: move the kept entries into place
            counts = [len(slots) for slots in keep]
            high = max(counts)
            if any(slots != list(range(len(slots))) for slots in keep):
                order = [slots + [0] * (high - len(slots)) for slots in keep]
                gather_entries(self.cache, base, torch.tensor(order, device=self.device))
        else:
            counts = list(keep)
            high = max(counts)
        truncate(self.cache, base + high)
        if min(counts) == high and self.key_valid is None:
            return
        if self.key_valid is None:  # the first hole: from now on validity is tracked per entry
            self.key_valid = torch.ones(self.batch, base + new, dtype=torch.bool, device=self.device)
        kept = torch.arange(high, device=self.device)[None] < torch.tensor(counts, device=self.device)[:, None]
        self.key_valid = torch.cat([self.key_valid[:, :base], kept & self.key_valid[:, base : base + high]], dim=1)

    @property
    def sampling(self) -> bool:
        """Whether any row samples (temperature > 0): else every `sample` is greedy."""
        return any(sampler.temperature > 0 for sampler in self.samplers)

    def sampled_rows(self) -> torch.Tensor:
        """[B] bool: the rows that sample (temperature > 0)."""
        return torch.tensor([sampler.temperature > 0 for sampler in self.samplers], device=self.device)

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens [B, ...] for logits [B, ..., V], the tokens to sit at RoPE `positions` [B, ...]:
        each row greedy, or sampled by its sampler with the row's draw for each position (a
        token's position keys its draw, `fastforward.decoding.sampling`; greedy ignores it).
        Rows of different samplers are sampled group by group, each row as it would be alone."""
        groups = self._sampling_groups
        if groups is None:
            groups = self._sampling_groups = self._group_samplers()
        if not groups:
            return greedy(logits)
        if self._sampling_keys is None:  # a row's own seed, else its sampler's, hashed with its tokens
            keys = [
                row_key(sampler.seed if own is None else own, prefix, suffix)
                for own, sampler, prefix, suffix in zip(
                    self.seeds, self.samplers, self.prefixes, self.suffixes, strict=True
                )
            ]
            self._sampling_keys = torch.tensor(keys, device=self.device)
        draws = uniforms(self._sampling_keys, positions)
        if len(groups) == 1 and groups[0][1] is None:  # every row alike
            return groups[0][0].inverse_cdf(logits, draws)
        tokens = greedy(logits)
        for sampler, rows in groups:
            tokens[rows] = sampler.inverse_cdf(logits[rows], draws[rows])
        return tokens

    def _group_samplers(self) -> list[tuple[Sampler, torch.Tensor | None]]:
        """The samplers at temperature > 0 with the rows they sample (None: every row)."""
        rows_of: dict[tuple[float, float], list[int]] = {}
        for row, sampler in enumerate(self.samplers):
            if sampler.temperature > 0:
                rows_of.setdefault((sampler.temperature, sampler.top_p), []).append(row)
        if len(rows_of) == 1 and len(next(iter(rows_of.values()))) == self.batch:
            return [(self.samplers[0], None)]
        return [(self.samplers[rows[0]], torch.tensor(rows, device=self.device)) for rows in rows_of.values()]

    # ---- the canvas ---------------------------------------------------------------------------
    def commit(self, tokens: torch.Tensor, at: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Write tokens [B, k] at canvas positions `at` [B, k] where `mask` (default: all) holds.

        Finished rows and positions past a row's budget are left alone. One read-back of the
        tokens, then host updates of each row's canvas, frontier, first stop and done.
        """
        k = tokens.shape[1]
        parts = [tokens, at] if mask is None else [tokens, at, mask.long()]
        for row, values in enumerate(torch.cat(parts, dim=1).tolist()):
            chosen = values[2 * k :] if mask is not None else [1] * k
            self._write(row, [(a, t) for t, a, m in zip(values[:k], values[k : 2 * k], chosen, strict=True) if m])
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
        for row, line in enumerate(tokens):
            n = len(line) if count is None else count[row]
            self._write(row, list(enumerate(line[:n], self.frontiers[row])))
        self._mirrors.clear()

    def _write(self, row: int, writes: list[tuple[int, int]]) -> None:
        """Put (position, token) pairs on one row's canvas; then its frontier, first stop and done."""
        if self.finished_rows[row]:
            return
        canvas, limit, stops = self.canvas[row], self.limits[row], self.stop_sets[row]
        written = 0
        for position, token in writes:
            if 0 <= position < limit:
                canvas[position] = token
                written += 1
                if token in stops and position < self.first_stops[row]:
                    self.first_stops[row] = position
        if self._step is not None:
            self._step.committed[row] += written
        frontier = self.frontiers[row]
        while frontier < limit and canvas[frontier] is not None:
            frontier += 1
        self.frontiers[row] = frontier
        if frontier >= min(limit, self.first_stops[row] + 1):
            self.finished_rows[row] = True

    @property
    def frontier(self) -> torch.Tensor:
        """Each row's leading committed positions [B], on the device (built when asked for)."""
        if "frontier" not in self._mirrors:
            self._mirrors["frontier"] = torch.tensor(self.frontiers, device=self.device)
        return self._mirrors["frontier"]

    @property
    def done(self) -> torch.Tensor:
        """Which rows have finished [B], on the device (built when asked for)."""
        if "done" not in self._mirrors:
            self._mirrors["done"] = torch.tensor(self.finished_rows, device=self.device)
        return self._mirrors["done"]

    @property
    def lengths(self) -> list[int]:
        """Each row's output length so far: its leading committed positions, up to its stop token."""
        return [min(f, s + 1) for f, s in zip(self.frontiers, self.first_stops, strict=True)]

    @property
    def nfe(self) -> torch.Tensor:
        """Decoding forwards each row took part in [B]."""
        return torch.tensor(self.forwards)

    def span(self, start: int, length: int) -> torch.Tensor:
        """RoPE positions [B, length] from `start` positions past each row's frontier (start -1: the
        last committed token), built on the host in one transfer."""
        firsts = [o + f + start for o, f in zip(self.origins, self.frontiers, strict=True)]
        return torch.tensor([list(range(p, p + length)) for p in firsts], device=self.device)

    @property
    def next_pos(self) -> torch.Tensor:
        """Each row's RoPE position of its first uncommitted canvas position [B]."""
        return self.origin + self.frontier

    @property
    def produced(self) -> int:
        """The most leading positions committed by a row still running (0 when none runs)."""
        return max((f for f, d in zip(self.frontiers, self.finished_rows, strict=True) if not d), default=0)

    def row_tokens(self) -> int | None:
        """The tokens each running row may put in a forward under `step_tokens` (None: no bound)."""
        if self.step_tokens is None:
            return None
        return self.step_tokens // max(1, self.batch - sum(self.finished_rows))

    @property
    def finished(self) -> bool:
        return all(self.finished_rows)

    @property
    def outputs(self) -> list[list[int]]:
        """Each row's output so far: committed tokens in position order, up to its stop token."""
        return [row[:n] for row, n in zip(self.canvas, self.lengths, strict=True)]  # type: ignore[misc]

    def histograms(self) -> list[dict[int, int]]:
        """Per row: how many of its steps committed k tokens, for each k (steps it took part in)."""
        return [dict(counts) for counts in self.steps]

    def results(self) -> list[Generation]:
        return [self.result(row) for row in range(self.batch)]

    def result(self, row: int) -> Generation:
        ids = self.outputs[row]
        seconds = time.perf_counter() - self.started[row]
        stats = Stats(
            self.forwards[row], len(ids), seconds, self.prefill_times[row], dict(self.steps[row]), self.queries[row]
        )
        return Generation(ids, self.model.decode(ids), stats, self.finish_reason(row))

    # ---- rows joining and leaving (continuous batching) -----------------------------------------
    def per_row(self, name: str) -> list:
        """A decoder's per-row list `name` (None for rows it has not begun): `join` extends it and
        `leave` drops the rows that left, so row r's entry stays row r's."""
        if name not in self.row_state:
            self.row_state[name] = [None] * self.batch
        return self.row_state[name]

    def join(
        self, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int | Sequence[int], drop: Sequence[int] = ()
    ) -> list[int]:
        """Add rows between steps (and drop the rows `drop`, whose generations the caller has read with
        `result`); returns the new rows' indices. The new rows are prefilled on their own, as a session
        of them would be. Where as many rows are dropped as join (or more), the new rows take the
        dropped rows' places and their cache entries are written over those rows' (the other rows' are
        not copied; any further dropped rows then leave); otherwise the staying rows keep their order
        and the new rows' entries are stacked under theirs in one copy. Either way the shorter side is
        left-padded with entries no query sees, and rows other than the dropped ones keep their
        entries in every per-row list (`per_row`), so callers follow rows by these indices. The new
        rows' `next_logits` are set, and the decoder begins them (`Decoder.begin`). max_new_tokens:
        one budget, or one per prompt."""
        if self._step is not None:
            raise RuntimeError("rows join between steps: call session.advance first")
        new = Session(self.model, prompts, max_new_tokens, self.suffix_upfront, self.sampler)
        drop = sorted(drop)
        if len(drop) >= new.batch:
            slots = drop[: new.batch]
            if overwrite_rows(self.cache, torch.tensor(slots, device=self.device), new.cache):
                return self._take_places(new, slots, gone=drop[new.batch :])
        stay, index = self._staying(drop)
        mine, theirs = self.cache.get_seq_length(), new.cache.get_seq_length()
        width = max(mine, theirs)
        valids = []
        for session, rows, length in ((self, index, mine), (new, None, theirs)):
            valid = validity(session.key_valid, session.batch, length, self.device)
            valids.append(F.pad(valid if rows is None else valid[rows], (width - length, 0), value=False))
        rows = [stay if drop else None, None]  # nothing dropped: the running rows as they are
        self.cache = stack_rows(self.model.hf.config, [self.cache, new.cache], [width - mine, width - theirs], rows)
        self._keep_rows(stay, index)
        self.key_valid = torch.cat(valids)
        added = list(range(self.batch, self.batch + new.batch))
        for name in self._ROW_LISTS:
            getattr(self, name).extend(getattr(new, name))
        for values in self.row_state.values():
            values.extend([None] * new.batch)
        self.batch += new.batch
        self.max_new_tokens = max(self.limits)
        self.origin = torch.cat([self.origin, new.origin])
        self.next_logits = torch.cat([self.next_logits, new.next_logits])
        self._squeeze()
        return added

    def _take_places(self, new: Session, slots: list[int], gone: list[int]) -> list[int]:
        """`join`'s rows of `new` in the rows `slots` (their cache entries written already), then the
        rows `gone` leave; returns where the new rows are."""
        at = torch.tensor(slots, device=self.device)
        width, theirs = self.cache.get_seq_length(), new.cache.get_seq_length()
        valid = validity(self.key_valid, self.batch, width, self.device)
        new_valid = F.pad(validity(new.key_valid, new.batch, theirs, self.device), (width - theirs, 0), value=False)
        self.key_valid = valid.index_put((at,), new_valid)
        for name in self._ROW_LISTS:
            values, others = getattr(self, name), getattr(new, name)
            for slot, value in zip(slots, others, strict=True):
                values[slot] = value
        for values in self.row_state.values():
            for slot in slots:
                values[slot] = None
        self._cancelled -= set(slots)
        self.origin = self.origin.index_put((at,), new.origin)
        self.next_logits = self.next_logits.index_put((at,), new.next_logits)
        self.max_new_tokens = max(self.limits)
        self._sampling_keys = self._sampling_groups = None
        self._mirrors.clear()
        if gone:
            stay = self._remove(gone)
            slots = [stay.index(slot) for slot in slots]
        self._squeeze()
        return slots

    def leave(self, rows: Sequence[int]) -> list[Generation]:
        """Remove rows between steps (finished or cancelled), returning their generations. The cache
        keeps the other rows' entries; entries no remaining row sees are dropped (`_squeeze`)."""
        if self._step is not None:
            raise RuntimeError("rows leave between steps: call session.advance first")
        results = [self.result(row) for row in rows]
        self._remove(rows)
        if self.key_valid is not None:
            self._squeeze()
        return results

    def _remove(self, rows: Sequence[int]) -> list[int]:
        """The rows `rows` out of the session, cache included; returns the staying rows' old indices."""
        stay, index = self._staying(rows)
        self.cache.batch_select_indices(index)
        if getattr(self.cache, "key_positions", None) is not None:
            self.cache.key_positions = self.cache.key_positions[index]
        self._keep_rows(stay, index)
        return stay

    def _staying(self, gone: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """The rows not in `gone`, in order, and their indices on the device."""
        leaving = set(gone)
        stay = [row for row in range(self.batch) if row not in leaving]
        return stay, torch.tensor(stay, dtype=torch.long, device=self.device)

    def _keep_rows(self, stay: list[int], index: torch.Tensor) -> None:
        """Everything but the cache, for the rows `stay` alone (in that order)."""
        if self.key_valid is not None:
            self.key_valid = self.key_valid[index]
        for name in self._ROW_LISTS:
            values = getattr(self, name)
            values[:] = [values[row] for row in stay]
        for values in self.row_state.values():
            values[:] = [values[row] for row in stay]
        self._cancelled = {stay.index(row) for row in self._cancelled if row in stay}
        self.batch = len(stay)
        self.max_new_tokens = max(self.limits, default=0)
        self.origin = self.origin[index]
        self.next_logits = self.next_logits[index]
        self._sampling_keys = self._sampling_groups = None
        self._mirrors.clear()

    SQUEEZE_SLACK = 64  # entries a cache may hold beyond twice its longest row before it is repacked

    def _squeeze(self) -> None:
        """Drop cache entries no row sees: leading padding, and once holes (entries rows did not keep)
        make up most of the cache, every hole: each row's valid entries are packed to the right. A
        session that rows keep joining would otherwise grow by the longest step of any row, forever.
        A single row keeps only its valid entries, and no mask."""
        valid, length = self.key_valid, self.key_valid.shape[1]
        if not self.batch:  # every row left: nothing to keep
            drop_leading(self.cache, length)
            self.key_valid = valid[:, :0]
            return
        if self.batch == 1:
            # One row needs no mask once its holes are gone: its steps then run as a prompt's alone do
            # (with compiled steps, one kind of step fewer for a server to compile).
            if not bool(valid.all()):
                repack(self.cache, valid[0].nonzero().reshape(1, -1))
            self.key_valid = None
            return
        width = int(valid.sum(dim=1).max())
        if length > 2 * width + self.SQUEEZE_SLACK:  # amortised: each repack at least halves the cache
            slots = torch.arange(length, device=self.device).expand(self.batch, -1)
            # each row's valid slots in order, right-aligned into `width` (the left filled with slot 0)
            ranked = torch.where(valid, slots, -1).sort(dim=1).values[:, length - width :]
            repack(self.cache, ranked.clamp(min=0))
            self.key_valid = ranked >= 0
            return
        lead = int(valid.any(dim=0).long().argmax())
        if lead:
            drop_leading(self.cache, lead)
            self.key_valid = valid[:, lead:]

    # The host lists indexed by row, which `join` extends and `leave` filters.
    _ROW_LISTS = (
        "limits", "context_bound", "prefixes", "origins", "suffixes", "samplers", "seeds", "canvas", "frontiers",
        "first_stops", "finished_rows", "forwards", "queries", "steps", "started", "prefill_times", "stop_sets",
    )  # fmt: skip

    def finish_reason(self, row: int) -> str:
        """Why a row ended (see `Generation`); "interrupted" while it has not."""
        if not self.finished_rows[row]:
            return "interrupted"
        if row in self._cancelled:
            return "cancelled"
        if self.first_stops[row] < self.frontiers[row]:
            return "stop"
        return "context" if self.context_bound[row] else "length"


@dataclass
class _Step:
    """The open step: where its entries start in the cache, how many, who takes part, what it committed."""

    base: int
    new: int
    rows: list[bool]
    committed: list[int]
