"""The decoder protocol: given a prefilled `Session` (`fastforward.runtime`), decode until every row stops."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from fastforward.model import Model
from fastforward.runtime import Generation, GenerationInterrupted, Prompt, Session


class Decoder(ABC):
    """A decoding method. Its `decode` drives the session's step protocol until `session.finished`."""

    name: str

    @abstractmethod
    def decode(self, session: Session) -> None:
        """Fill the session's canvas through `session.forward` / `commit` / `advance`."""

    def generate(
        self, model: Model, prompts: Sequence[Sequence[int] | Prompt], max_new_tokens: int = 256
    ) -> list[Generation]:
        with torch.inference_mode():
            session = Session(model, prompts, max_new_tokens)
            try:
                self.decode(session)
            except KeyboardInterrupt as interrupt:
                raise GenerationInterrupted(session.results()) from interrupt
            return session.results()
