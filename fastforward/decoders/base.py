"""What every decoder shares: a batched session over one KV cache, the stats type, the protocol.

A `Session` left-pads a batch of prompts, prefills them causally, and then runs layouts for a
decoder: it tracks which cache slots are real tokens, each row's next RoPE position, the tokens
each row has generated, when each row stopped, and how many forwards each row took part in.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field

import torch

from fastforward import visibility
from fastforward.cache import keep_entries, truncate
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


class Session:
    """A batch being decoded: cache, padding, positions, outputs and per-row counters."""

    def __init__(self, model: Model, prompts: list[list[int]], max_new_tokens: int):
        if not prompts:
            raise FastForwardError("no prompts given")
        if max_new_tokens <= 0:
            raise FastForwardError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise FastForwardError("a prompt is empty; give at least one token")
        context = model.max_context
        if context is not None and max(lengths) >= context:
            raise FastForwardError(
                f"a prompt has {max(lengths)} tokens but the model's context is {context}; shorten the prompt"
            )
        self.model = model
        self.device = model.device
        self.batch = len(prompts)
        # Generation stops at the context length as well as at max_new_tokens.
        room = min(context - n for n in lengths) if context is not None else max_new_tokens
        self.max_new_tokens = min(max_new_tokens, room)
        self.stop_ids = torch.tensor(model.stop_token_ids or [-1], device=self.device)
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.done = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        self.nfe = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        self.steps: list[Counter] = [Counter() for _ in prompts]
        self.cache = model.new_cache()
        self.start = time.perf_counter()
        self.next_logits = self._prefill(prompts)
        self.prefill_seconds = time.perf_counter() - self.start

    # ---- layout execution --------------------------------------------------------------------
    def _prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Left-padded causal prefill; returns each row's next-token logits [B, V]."""
        width = max(len(p) for p in prompts)
        pads = torch.tensor([width - len(p) for p in prompts], device=self.device)
        tokens = torch.full((self.batch, width), self.model.pad_token_id, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt) :] = torch.tensor(prompt, device=self.device)
        slots = torch.arange(width, device=self.device)
        self.key_valid = torch.ones(self.batch, 0, dtype=torch.bool, device=self.device)
        self.padded = any(len(p) != width for p in prompts)
        self.next_pos = width - pads
        positions = (slots[None] - pads[:, None]).clamp_min(0)
        real = slots[None] >= pads[:, None]
        return self.run(tokens, positions, None, read=[width - 1], keep=width, new_valid=real)[:, 0]

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rule: torch.Tensor | None,
        read: list[int],
        keep: int,
        new_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run new tokens under `rule` (they also see the whole valid cache); keep the first `keep`.

        rule None means causal. Returns float32 logits [B, len(read), V]. `new_valid` marks
        padding among the new tokens.
        """
        if new_valid is None:
            new_valid = torch.ones_like(tokens, dtype=torch.bool)
        keys = torch.cat([self.key_valid, new_valid], dim=1)
        if rule is None and not self.padded:
            mask = None  # the model's own causal path: no dense mask to build or read
        else:
            rule = visibility.causal(tokens.shape[1], self.device) if rule is None else rule
            mask = visibility.against_cache(rule, keys)
        read_idx = torch.tensor(read, dtype=torch.long, device=self.device)
        logits = self.model.run(Layout(tokens, positions, mask, read_idx, keep), self.cache)
        self.key_valid = keys[:, : self.key_valid.shape[1] + keep]
        return logits

    def keep_accepted(self, new: int, accepted: torch.Tensor) -> None:
        """After a forward that kept all `new` entries, keep only each row's first `accepted[r]`.

        The cache is rectangular, so it is cut to the longest row; shorter rows' extra slots are
        marked invalid (holes that no later query sees). With one row nothing is ever a hole.
        """
        longest = int(accepted.max())
        truncate(self.cache, self.cache.get_seq_length() - new + longest)
        base = self.key_valid.shape[1] - new
        slots = torch.arange(longest, device=self.device)
        self.key_valid = torch.cat([self.key_valid[:, :base], slots[None] < accepted[:, None]], dim=1)
        if self.batch > 1 and bool((accepted < longest).any()):
            self.padded = True

    def keep_picked(self, new: int, picks: torch.Tensor) -> None:
        """After a forward that kept all `new` entries, keep only new entries `picks` (every row alike)."""
        keep_entries(self.cache, self.cache.get_seq_length() - new, picks)
        base = self.key_valid.shape[1] - new
        self.key_valid = self.key_valid[:, : base + len(picks)]

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def produced(self) -> int:
        """Tokens generated so far by the rows still running (all rows advance in lockstep)."""
        return max(len(out) for out in self.outputs)

    def count_forward(self) -> None:
        self.nfe += (~self.done).long()

    def record_step(self, revealed: list[int]) -> None:
        """Histogram of tokens revealed by one decoding forward, for the rows still running."""
        for row, n in enumerate(revealed):
            if not self.done[row]:
                self.steps[row][n] += 1

    def finish_rows(self, block: torch.Tensor, accepted: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Append the accepted tokens (`accepted[r]` of `block[r]`) of `rows` (default: the running
        rows), cutting at a stop token; rows that stop or reach max_new_tokens are marked done."""
        block_list, accepted_list = block.tolist(), accepted.tolist()
        is_stop = torch.isin(block, self.stop_ids).tolist()
        rows_list = (~self.done if rows is None else rows).tolist()
        for row in range(self.batch):
            if not rows_list[row]:
                continue
            take = accepted_list[row]
            stops = [i for i in range(take) if is_stop[row][i]]
            if stops:
                take = stops[0] + 1
                self.done[row] = True
            self.outputs[row].extend(block_list[row][:take])
            if len(self.outputs[row]) >= self.max_new_tokens:
                del self.outputs[row][self.max_new_tokens :]
                self.done[row] = True

    def results(self) -> list[Generation]:
        seconds = time.perf_counter() - self.start
        out = []
        for row in range(self.batch):
            stats = Stats(
                nfe=int(self.nfe[row]),
                tokens=len(self.outputs[row]),
                seconds=seconds,
                prefill_seconds=self.prefill_seconds,
                tokens_per_step=dict(self.steps[row]),
            )
            out.append(Generation(self.outputs[row], self.model.decode(self.outputs[row]), stats))
        return out


class Decoder(ABC):
    """A decoding method: given a prefilled session, generate until every row stops."""

    name: str

    @abstractmethod
    def decode(self, session: Session) -> None:
        """Fill `session.outputs`, running layouts through `session.run`."""

    def generate(self, model: Model, prompts: list[list[int]], max_new_tokens: int = 256) -> list[Generation]:
        with torch.inference_mode():
            session = Session(model, prompts, max_new_tokens)
            self.decode(session)
            return session.results()
