"""The decoder protocol: given a prefilled `Session` (`fastforward.decoding.runtime`), decode until every row stops."""

from __future__ import annotations

from abc import ABC
from collections.abc import Sequence

import torch

from fastforward.decoding.runtime import Generation, GenerationInterrupted, Prompt, Session
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError
from fastforward.model import Model


class Decoder(ABC):
    """A decoding method. Its `decode` drives the session's step protocol until `session.finished`."""

    name: str
    rows_apart: bool = False  # decode a batch one prompt at a time (for layouts that differ per row)
    infills: bool = False  # can fill the gap of an infilling `Prompt` (prefix, gap, suffix)
    sampler: Sampler = Sampler()  # how the sessions it opens choose tokens (`Session.sample`)
    continuous: bool = False  # decodes by `begin` and `step`: rows may join and leave between steps

    def decode(self, session: Session) -> None:
        """Fill the session's canvas through `session.forward` / `commit` / `advance`. A continuous
        decoder begins every row and steps until all have finished; the others override this."""
        if not self.continuous:
            raise NotImplementedError(f"{type(self).__name__} defines neither decode nor begin and step")
        self.begin(session, range(session.batch))
        while not session.finished:
            self.step(session)

    def begin(self, session: Session, rows: range) -> None:
        """Start the rows `rows` of a session, just prefilled (or joined): their first tokens from
        `session.next_logits` and their per-row state (`session.per_row`)."""
        raise NotImplementedError(f"{self.name} does not decode step by step")

    def step(self, session: Session) -> None:
        """One step of every running row: at most one forward, closed by `session.advance`."""
        raise NotImplementedError(f"{self.name} does not decode step by step")

    def open_session(self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int) -> Session:
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
        if self.rows_apart and len(prompts) > 1:
            done: list[Generation] = []
            for prompt in prompts:
                try:
                    done += self.generate(model, [prompt], max_new_tokens)
                except GenerationInterrupted as interrupt:  # the rows before it are complete
                    raise GenerationInterrupted([*done, *interrupt.generations]) from interrupt
            return done
        with torch.inference_mode():
            session = self.open_session(model, prompts, max_new_tokens)
            try:
                self.decode(session)
            except KeyboardInterrupt as interrupt:
                raise GenerationInterrupted(session.results()) from interrupt
            return session.results()
