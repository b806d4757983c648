"""A streamed row's text: its tokens turned into text deltas as they arrive, cut before a stop string."""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """A row's text as its tokens arrive: each push returns only the new, complete text, and nothing
    from the first stop string on.

    Incremental, so streaming n tokens costs O(n), not a decode of the whole text per step: a push
    decodes a short window, the tokens not yet out plus those of the piece of text before them (so a
    tokenizer that spaces a word by what precedes it decodes it as in the whole text), and sends what
    the new tokens add. A window whose text ends in U+FFFD (a multi-byte character split across
    tokens) waits for the tokens that complete it, until `final`; byte-level BPE text sent this way
    concatenates to exactly the decode of all the tokens. Text that could begin a stop string waits
    until it does not (or `final`), so the text is cut exactly before the first stop string, even
    one that spans several steps.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.ids: list[int] = []
        self.start = 0  # the window's first token: the piece of text before the tokens not yet out
        self.out = 0  # tokens whose text is out (sent, or held for a stop string)
        self.held = ""  # text out of the tokens but not sent: it may begin a stop string

    def push(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
        """Add tokens; returns the text to send and whether a stop string ended the text."""
        self.ids += ids
        before = self.decode(self.ids[self.start : self.out])
        text = self.decode(self.ids[self.start :])
        new = ""
        if final or not text.endswith("\ufffd"):
            new = text[len(before) :]
            self.start, self.out = self.out, len(self.ids)
        pending = self.held + new
        cut = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            return pending[:cut], True
        wait = 0 if final else self._stop_start(pending)
        self.held = pending[len(pending) - wait :] if wait else ""
        return pending[: len(pending) - wait], False

    def _stop_start(self, text: str) -> int:
        """How many of the text's last characters begin a stop string (the longest such ending)."""
        return max(
            (n for s in self.stop for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0
        )
