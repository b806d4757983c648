"""The decoder protocol: `begin` rows of a prefilled `Session` (`fastforward.decoding.runtime`), then
`step` until every row stops. Rows may join and leave between steps (the server's continuous
batching), so a decoder keeps each row's state in `Row.state`, which follows the row. A decoder is a
dataclass whose fields are its options (`decoders.registry`), checked when it is made."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from fastforward.decoding.options import check_options
from fastforward.decoding.runtime import Generation, GenerationInterrupted, Prompt, Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.model import Model


class Decoder(ABC):
    """A decoding method, as `begin` and `step` on a session's rows."""

    name: str  # given by `decoders.registry.register`
    infills: bool = False  # can fill the gap of an infilling `Prompt` (prefix, gap, suffix)
    # Its rows' caches always equal a causal prefill of their prompts and first committed tokens (not
    # so where tokens are cached in the order they were revealed).
    causal_cache: bool = True
    sampler: Sampler = Sampler()  # how the sessions it opens choose tokens (`Session.sample`)

    def __post_init__(self) -> None:
        """Refuse option values outside their bounds, however the decoder is made (the CLI, the server
        and Python alike); a decoder with rules between its options checks them after these."""
        check_options(self)

    @abstractmethod
    def begin(self, session: Session, rows: Sequence[int]) -> None:
        """Start the rows `rows` of a session, just prefilled (or joined): their first tokens from
        `session.next_logits` where the method takes them so, and their `state`."""

    @abstractmethod
    def step(self, session: Session) -> None:
        """One step of every running row: at most one forward, closed by `session.advance`."""

    def decode(self, session: Session) -> None:
        """Begin every row of the session and step until all have finished."""
        self.begin(session, range(session.batch))
        while not session.finished:
            self.step(session)

    def open_session(
        self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int | Sequence[int]
    ) -> Session:
        """The session this decoder decodes (a decoder may choose how it is prefilled)."""
        return Session(model, prompts, max_new_tokens, sampler=self.sampler)

    def generate(
        self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int = 256
    ) -> list[Generation]:
        if not self.infills and any(isinstance(p, Prompt) and p.suffix for p in prompts):
            raise FastForwardError(
                f"the {self.name} decoder cannot infill (fill a gap before a suffix); use the setdlm decoder, "
                "or ar on the prefix alone as the baseline"
            )
        with torch.inference_mode():
            session = self.open_session(model, prompts, max_new_tokens)
            try:
                self.decode(session)
            except KeyboardInterrupt as interrupt:
                raise GenerationInterrupted(session.results()) from interrupt
            return session.results()
