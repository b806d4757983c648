"""The decoder protocol: `begin` rows of a prefilled `Session` (`fastforward.decoding.runtime`), then
`step` them, one forward each time; whoever drives the session (the engine core,
`fastforward.decoding.engine_core`) loops, and takes finished rows out between steps. Rows join and
leave between steps, so a decoder keeps each row's state in `Row.state`, which follows the row. A decoder is a
dataclass whose fields are its options (`decoders.registry`), checked when it is made; rows of
decoders with equal options (`batch_key`) can share a batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import fields

import torch

from fastforward.decoding import engine_core, runtime
from fastforward.decoding.runtime import Generation, Prompt, Row, Session
from fastforward.decoding.sampling import Sampler
from fastforward.model import Model
from fastforward.model.cache import KVCache
from fastforward.options import check_options


class Decoder(ABC):
    """A decoding method, as `begin` and `step` on a session's rows."""

    name: str  # given by `decoders.registry.register`
    infills: bool = False  # can fill the gap of an infilling `Prompt` (prefix, gap, suffix)
    # Its rows' caches always equal a causal prefill of their prompts and first committed tokens (not
    # so where tokens are cached in the order they were revealed).
    causal_cache: bool = True
    suffix_upfront: bool = True  # the prefill caches an infilling row's suffix (else the decoder brings it in)
    sampler: Sampler = Sampler()  # how the rows it starts choose tokens, unless a prompt has its own

    def __post_init__(self) -> None:
        """Refuse option values outside their bounds, however the decoder is made (the CLI, the server
        and Python alike); a decoder with rules between its options checks them after these."""
        check_options(self)

    def batch_key(self) -> tuple[Hashable, ...]:
        """What rows must share to share a batch: the decoder's class and its option values, the sampler
        aside (each row samples with its own). Decoders with equal keys step rows alike."""
        return (type(self), *((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "sampler"))

    @abstractmethod
    def begin(self, session: Session, rows: Sequence[int]) -> None:
        """Start the rows `rows` of a session, just prefilled (or joined): their first tokens from
        `session.next_logits` where the method takes them so, and their `state`."""

    @abstractmethod
    def step(self, session: Session) -> None:
        """One step of every running row: at most one forward, closed by `session.advance`."""

    def prefilled(
        self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int | Sequence[int]
    ) -> tuple[list[Row], KVCache, torch.Tensor]:
        """New rows of `prompts` for this decoder, prefilled (`runtime.prefilled`): a new session's, or
        rows to join one."""
        return runtime.prefilled(model, prompts, max_new_tokens, self.sampler, self.suffix_upfront)

    def open_session(
        self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int | Sequence[int]
    ) -> Session:
        """A batch of `prompts` for this decoder, prefilled, to drive step by step (`begin`, `step`)."""
        return Session(model, *self.prefilled(model, prompts, max_new_tokens))

    def generate(
        self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int = 256
    ) -> list[Generation]:
        """Decode `prompts` in this process, all in one batch (`engine_core.generate`)."""
        return engine_core.generate(model, self, prompts, max_new_tokens)
