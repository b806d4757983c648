"""Multi-Block Diffusion decoding (MBD-LMs' "MultiBD" Block Buffer), training-free on a mask model.

Several blocks of masks are decoded at once. A row's Block Buffer holds up to `buffer_size`
running blocks of `block_size` positions; a block goes active → to-cache → in-cache:

* **Activation.** A new block opens right after the last one when that block's progress (share
  of its positions revealed) is at least `add_threshold`, fewer than `buffer_size` blocks are
  running, at most `buffer_size` blocks (running or to-cache) are in the buffer, and the row's
  budget (and its first revealed stop token) leaves room; the last block may be shorter.
* **Acceptance.** After a forward every masked position whose confidence (max probability) is
  above `accept_threshold` is revealed with its token: greedy, or sampled from its distribution
  with the position's own draw (`fastforward.decoding.sampling`). A block where none passes reveals
  its most confident position only if it is the front running block or the block before it was
  at least `semi_threshold` complete (before this forward); otherwise it waits.
* **Commit.** A block with nothing masked whose predecessor is to-cache or in-cache (or that is
  the front block) becomes to-cache. The next forward carries the to-cache blocks first, causal
  among themselves, and keeps only their entries; the running blocks follow and are read. Then
  they are in-cache and leave the buffer. So the cache always equals a causal prefill of the
  committed tokens (the SBD way, `decoders/sbd.py`).

One forward is `[to-cache blocks (causal, kept) ; running blocks (block-causal, read)]`, see
`visibility.block_causal_decode`. A forward holds at most `buffer_size + 1` blocks: one to-cache
block may share its forward with a block opened in its place, so no forward is spent on writing
the cache alone (the reference engine counts to-cache blocks against the buffer and spends one);
with `buffer_size` 1 this is SBD with a threshold policy. Tokens are committed to the canvas when
revealed; positions after a revealed stop token are never revealed, and blocks past it are
dropped.

`static=True` feeds every forward at the fixed width `(buffer_size + 1) × block_size`, unused
slots filled with padding that sees only itself and is seen by nothing (the fixed shape a CUDA
graph needs). The schedule is the same, so the tokens are too; only the cost per forward moves.

Rows of a batch share each forward, each with its own buffer: a row's layout is padded to the
widest with slots that see only themselves, its rule is its own, and it keeps only its to-cache
blocks' entries, so a batch gives the tokens of each prompt alone. MultiTF (`objectives.multitf`) trains a mask model
on states like this decoder's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, register, sampling
from fastforward.decoding.policies import entropy_and_confidence, most_confident
from fastforward.decoding.runtime import Row, Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import commit_writes
from fastforward.model import visibility
from fastforward.options import AT_LEAST_ONE, FRACTION, option


@dataclass
class _Block:
    """One buffer slot in use: canvas positions [start, start + len(tokens)), its tokens (None:
    still masked; positions after a revealed stop count as done) and whether it is to-cache."""

    start: int
    tokens: list[int | None]
    done: list[bool]
    to_cache: bool = False

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def complete(self) -> bool:
        return all(self.done)

    @property
    def progress(self) -> float:
        return sum(self.done) / self.size


@dataclass
class BufferState:
    """A row's Block Buffer: its blocks in use, and how many canvas positions are in the cache."""

    buffer: list[_Block] = field(default_factory=list)
    cached: int = 0


@register(
    "mbd", summary="Multi-Block Diffusion: a buffer of mask blocks decoded at once, exact KV cache", needs_mask=True
)
@dataclass(eq=False)
class MultiBlockDiffusionDecoder(Decoder):
    """Block Buffer decoding, greedy or sampled; see the module docstring for the rules."""

    block_size: int = BLOCK_SIZE.field()
    buffer_size: int = option(2, "mbd: blocks decoded at once (Block Buffer slots)", AT_LEAST_ONE)
    add_threshold: float = option(0.1, "mbd: open a new block once the last one's progress reaches this", FRACTION)
    accept_threshold: float = option(0.9, "mbd: reveal every masked token whose confidence is above this", FRACTION)
    semi_threshold: float = option(
        0.9, "mbd: force a block's top token only if the block before it is this complete", FRACTION
    )
    static: bool = option(False, "mbd: feed every forward at the fixed width (buffer_size + 1) x block_size")
    sampler: Sampler = sampling()

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        session.model.require_mask_token(self.name)
        for index in rows:
            session.rows[index].state = BufferState()

    def step(self, session: Session) -> None:
        mask_id = session.model.require_mask_token(self.name)
        rows = session.rows
        layouts = [self._layout(row, mask_id) if not row.finished else None for row in rows]
        fixed = (self.buffer_size + 1) * self.block_size if self.static else 0
        width = max([fixed, *(len(ids) for ids, _, _, _ in filter(None, layouts))])
        ids, positions, rules, reads = [], [], [], []
        for row, layout in zip(rows, layouts, strict=True):
            if layout is None:  # a finished row: one padding slot, kept by nobody
                layout = ([mask_id], [row.origin + row.state.cached], 0, ())
            tokens, places, commit, sizes = layout
            ids.append(tokens + [mask_id] * (width - len(tokens)))
            positions.append(places + [places[-1]] * (width - len(tokens)))
            padding = width - commit - sum(sizes)  # a finished row's slot is padding too
            rules.append(visibility.block_causal_decode(commit, sizes, session.device, padding))
            reads.append((commit, len(tokens)))
        live = [read for read, layout in zip(reads, layouts, strict=True) if layout is not None]
        low, high = min(start for start, _ in live), max(end for _, end in live)
        layout = torch.tensor([ids, positions], device=session.device)  # tokens, positions
        rule = rules[0] if len(rules) == 1 else torch.stack(rules)
        logits = session.forward(layout[0], layout[1], rule, read=range(low, high))
        _, confidence = entropy_and_confidence(logits)
        tokens = session.sampler.sample(logits, layout[1, :, low:high])
        tokens, confidence = torch.stack([tokens.double(), confidence.double()]).tolist()
        writes = []
        for row, (start, end), chosen, sure in zip(rows, reads, tokens, confidence, strict=True):
            running_blocks = [b for b in row.state.buffer if not b.to_cache] if not row.finished else []
            reveals = self._choose(running_blocks, sure[start - low : end - low]) if running_blocks else []
            writes.append(self._writes(row, running_blocks, reveals, [int(t) for t in chosen[start - low :]]))
        commit_writes(session, writes)
        session.advance(keep=[start if layout else 0 for (start, _), layout in zip(reads, layouts, strict=True)])
        for row, row_writes, layout in zip(rows, writes, layouts, strict=True):
            if layout is not None:
                self._settle(row, row_writes, layout[2])

    def _layout(self, row: Row, mask_id: int) -> tuple[list[int], list[int], int, tuple[int, ...]]:
        """A running row's `[to-cache blocks ; running blocks]`: tokens, positions, how many are kept
        and the running blocks' sizes (after opening the blocks its progress allows)."""
        state: BufferState = row.state
        self._activate(row, state.buffer, state.cached)
        writing = [b for b in state.buffer if b.to_cache]
        running = [b for b in state.buffer if not b.to_cache]
        if not running:
            raise RuntimeError("mbd: no block to decode while the row is unfinished")
        ids = [t for b in writing for t in b.tokens]
        ids += [mask_id if t is None else t for b in running for t in b.tokens]
        first = row.origin + state.cached
        return ids, list(range(first, first + len(ids))), sum(b.size for b in writing), tuple(b.size for b in running)

    def _activate(self, row: Row, buffer: list[_Block], cached: int) -> None:
        """Open blocks after the last one while its progress allows and a slot and the budget are free."""
        end = min(row.limit, row.first_stop + 1)  # no position past a stop is decoded
        while sum(not b.to_cache for b in buffer) < self.buffer_size and len(buffer) <= self.buffer_size:
            start = buffer[-1].start + buffer[-1].size if buffer else cached
            if start >= end or (buffer and buffer[-1].progress < self.add_threshold):
                return
            size = min(self.block_size, row.limit - start)
            buffer.append(_Block(start, [None] * size, [False] * size))

    def _choose(self, running: list[_Block], confidence: list[float]) -> list[list[int]]:
        """Per running block, the offsets to reveal: those above the accept threshold, else the
        most confident one where forcing is allowed (the front block, or a semi-complete predecessor)."""
        chosen, offset = [], 0
        for i, block in enumerate(running):
            conf = confidence[offset : offset + block.size]
            offset += block.size
            masked = [j for j in range(block.size) if not block.done[j]]
            picks = [j for j in masked if conf[j] > self.accept_threshold]
            if masked and not picks and (i == 0 or running[i - 1].progress >= self.semi_threshold):
                picks = [most_confident(conf, masked)]
            chosen.append(picks)
        return chosen

    @staticmethod
    def _writes(row: Row, running: list[_Block], chosen: list[list[int]], tokens: list[int]) -> list[tuple[int, int]]:
        """The chosen (position, token) writes of a row, none after its first stop token."""
        writes, offset = [], 0
        for block, picks in zip(running, chosen, strict=True):
            writes += [(block.start + j, tokens[offset + j]) for j in picks]
            offset += block.size
        stop = min([row.first_stop, *(p for p, t in writes if t in row.stops)])
        return [(p, t) for p, t in writes if p <= stop]

    @staticmethod
    def _settle(row: Row, writes: list[tuple[int, int]], committed: int) -> None:
        """After a step's commit: the to-cache blocks are in the cache; the revealed tokens go into their
        blocks; positions past a stop are done and blocks wholly past it dropped; leading complete blocks
        (each after a to-cache one) go to the cache next."""
        state: BufferState = row.state
        state.cached += committed
        running = [b for b in state.buffer if not b.to_cache]
        for position, token in writes:
            for block in running:
                if block.start <= position < block.start + block.size:
                    block.tokens[position - block.start] = token
                    block.done[position - block.start] = True
        stop = row.first_stop
        running = [b for b in running if b.start <= stop]
        for block in running:
            for j in range(block.size):
                if block.start + j > stop:
                    block.done[j] = True
        for block in running:
            if not block.complete:
                break
            block.to_cache = True
        state.buffer = running
