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

Rows of a batch are decoded one after another (their buffers move independently), so a batch
gives exactly the tokens of each prompt alone. MultiTF (`objectives.multitf`) trains a mask model
on states like this decoder's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import BLOCK_SIZE, SAMPLING, Knob, fraction, register
from fastforward.decoding.policies import entropy_and_confidence
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.model import visibility


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


class MultiBlockDiffusionDecoder(Decoder):
    """Block Buffer decoding, greedy or sampled; see the module docstring for the rules."""

    name = "mbd"
    rows_apart = True

    def __init__(
        self,
        block_size: int = 16,
        buffer_size: int = 2,
        add_threshold: float = 0.1,
        accept_threshold: float = 0.9,
        semi_threshold: float = 0.9,
        static: bool = False,
        sampler: Sampler | None = None,
    ):
        if block_size <= 0 or buffer_size < 1:
            raise FastForwardError(f"need block_size > 0 and buffer_size >= 1, got {block_size} and {buffer_size}")
        for name, value in (("add", add_threshold), ("accept", accept_threshold), ("semi", semi_threshold)):
            if not 0 <= value <= 1:
                raise FastForwardError(f"the {name} threshold must be in [0, 1], got {value}")
        self.block_size, self.buffer_size = block_size, buffer_size
        self.add_threshold, self.accept_threshold, self.semi_threshold = add_threshold, accept_threshold, semi_threshold
        self.static = static
        self.sampler = sampler or Sampler()

    def decode(self, session: Session) -> None:
        if session.batch != 1:
            raise FastForwardError("the mbd decoder decodes one row per session (generate loops over prompts)")
        mask_id = session.model.require_mask_token(self.name)
        buffer: list[_Block] = []
        cached = 0  # canvas positions in the cache
        while not session.finished:
            self._activate(session, buffer, cached)
            writing = [b for b in buffer if b.to_cache]
            running = [b for b in buffer if not b.to_cache]
            if not running:
                raise RuntimeError("mbd: no block to decode while the row is unfinished")
            commit = sum(b.size for b in writing)
            ids = [t for b in writing for t in b.tokens]
            ids += [mask_id if t is None else t for b in running for t in b.tokens]
            first, used = session.origins[0] + cached, len(ids)
            padding = (self.buffer_size + 1) * self.block_size - used if self.static else 0
            positions = list(range(first, first + used)) + [first + used - 1] * padding
            layout = torch.tensor([ids + [mask_id] * padding, positions], device=session.device)
            sizes = tuple(b.size for b in running)
            rule = visibility.block_causal_decode(commit, sizes, session.device, padding)
            logits = session.forward(layout[:1], layout[1:], rule, read=range(commit, used))
            _, confidence = entropy_and_confidence(logits[0])
            tokens = session.sample(logits, layout[1:, commit:used])[0]
            tokens, confidence = torch.stack([tokens.double(), confidence.double()]).tolist()
            reveals = self._choose(running, confidence)
            self._reveal(session, running, reveals, [int(t) for t in tokens])
            session.advance(keep=commit)
            cached += commit
            buffer = running
            for block in buffer:  # leading complete blocks (each after a to-cache one) go to the cache next
                if not block.complete:
                    break
                block.to_cache = True

    def _activate(self, session: Session, buffer: list[_Block], cached: int) -> None:
        """Open blocks after the last one while its progress allows and a slot and the budget are free."""
        end = min(session.limits[0], session.first_stops[0] + 1)  # no position past a stop is decoded
        while sum(not b.to_cache for b in buffer) < self.buffer_size and len(buffer) <= self.buffer_size:
            start = buffer[-1].start + buffer[-1].size if buffer else cached
            if start >= end or (buffer and buffer[-1].progress < self.add_threshold):
                return
            size = min(self.block_size, session.limits[0] - start)
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
                picks = [max(masked, key=lambda j: (conf[j], -j))]  # the first on a tie
            chosen.append(picks)
        return chosen

    def _reveal(self, session: Session, running: list[_Block], chosen: list[list[int]], tokens: list[int]) -> None:
        """Commit the chosen tokens (none after the first stop token), then mark positions past a
        stop as done and drop blocks that lie wholly past it."""
        writes, offset = [], 0
        for block, picks in zip(running, chosen, strict=True):
            writes += [(block.start + j, tokens[offset + j]) for j in picks]
            offset += block.size
        stops = [p for p, t in writes if t in session.stop_sets[0]]
        stop = min([session.first_stops[0], *stops])
        writes = [(p, t) for p, t in writes if p <= stop]
        if writes:
            values = torch.tensor([[t for _, t in writes], [p for p, _ in writes]], device=session.device)
            session.commit(values[:1], values[1:])
        for position, token in writes:
            for block in running:
                if block.start <= position < block.start + block.size:
                    block.tokens[position - block.start] = token
                    block.done[position - block.start] = True
        stop = session.first_stops[0]
        running[:] = [b for b in running if b.start <= stop]
        for block in running:
            for j in range(block.size):
                if block.start + j > stop:
                    block.done[j] = True


@register(
    "mbd",
    knobs=(
        BLOCK_SIZE,
        Knob(
            "buffer_size",
            int,
            2,
            "mbd: blocks decoded at once (Block Buffer slots)",
            check=lambda v: v >= 1,
            rule=">= 1",
        ),
        fraction("add_threshold", 0.1, "mbd: open a new block once the last one's progress reaches this"),
        fraction("accept_threshold", 0.9, "mbd: reveal every masked token whose confidence is above this"),
        fraction("semi_threshold", 0.9, "mbd: force a block's top token only if the block before it is this complete"),
        Knob("static", bool, False, "mbd: feed every forward at the fixed width (buffer_size + 1) x block_size"),
        *SAMPLING,
    ),
    summary="Multi-Block Diffusion: a buffer of mask blocks decoded at once, exact KV cache",
    needs_mask=True,
)
def _build(
    block_size: int,
    buffer_size: int,
    add_threshold: float,
    accept_threshold: float,
    semi_threshold: float,
    static: bool,
    sampler: Sampler,
) -> MultiBlockDiffusionDecoder:
    return MultiBlockDiffusionDecoder(
        block_size, buffer_size, add_threshold, accept_threshold, semi_threshold, static, sampler
    )
