"""Prompt-lookup drafts: n-grams copied from the prompt and the text so far, no training, lossless.

When the last few committed tokens occurred before (in the prompt or in the output), the tokens that
followed them then are a draft for what follows now (prompt lookup decoding; `transformers`'
`prompt_lookup_num_tokens` and vLLM's n-gram proposer do the same). The draft is verified as a
candidate of a multi-block Jacobi forward (`steps.verify`), next to a short Jacobi
chain of the predictions the last forward made past its accepted tokens, so the output is exactly
AR decoding: greedy, or sampled (a draft token is then kept with the probability the model gives
it, `fastforward.decoding.sampling`).

A draft that stops paying costs little: with no n-gram match and nothing carried, a step is a
one-token forward on the model's own causal path (an AR step), and the draft length adapts
(`DraftLength`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fastforward.decoding.decoders.base import Decoder
from fastforward.decoding.decoders.registry import register, sampling
from fastforward.decoding.runtime import Session
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import chain_step, first_tokens, row_tokens, verify
from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, NON_NEGATIVE, option


class NgramIndex:
    """Where each n-gram (n ≤ max_match) of a growing text last occurred with a known next token."""

    def __init__(self, max_match: int, min_match: int = 1):
        self.max_match, self.min_match = max_match, min_match
        self.text: list[int] = []
        self.follower: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.text)  # the new token follows the n-grams that end just before it
            self.text.append(token)
            for n in range(1, min(self.max_match, end) + 1):
                self.follower[tuple(self.text[end - n : end])] = end

    def draft(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the longest recent match of the text's last tokens."""
        for n in range(min(self.max_match, len(self.text)), self.min_match - 1, -1):
            at = self.follower.get(tuple(self.text[-n:]))
            if at is not None:
                return self.text[at : at + length]
        return []


class DraftLength:
    """How many draft tokens the next step may verify (0: none, an AR step).

    As `transformers`' assistant does: two longer after a draft is accepted whole, one shorter
    otherwise, half as long when none of it was right. And where even one-token drafts keep
    failing (chat-like text whose n-grams recur with other continuations), drafting pauses for 1,
    2, 4, ... up to `MAX_PAUSE` steps: each failed draft made a block forward where an AR step's
    one-token forward would have done. Any accepted draft token ends the backing off.
    """

    MAX_PAUSE = 16

    def __init__(self, longest: int):
        self.longest, self.want = longest, longest
        self.pause, self.backoff = 0, 1

    def next(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        return self.want

    def update(self, drafted: int, won: int) -> None:
        """After a step that verified `drafted` draft tokens and accepted the first `won`."""
        if won:
            self.backoff = 1
        if won == drafted:
            self.want = min(self.want + 2, self.longest)
        elif won:
            self.want = max(self.want - 1, 1)
        elif drafted > 1:
            self.want = max(self.want // 2, 1)
        else:
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_PAUSE)


@dataclass
class LookupState:
    index: NgramIndex  # the row's prompt and output so far, where drafts are looked up
    last: int  # its last committed token
    length: DraftLength  # how long its next draft may be
    chain: list[int] = field(default_factory=list)  # predictions carried past its accepted tokens


@register(
    "lookup",
    summary="prompt lookup: n-gram drafts from the prompt and output, verified with a Jacobi chain",
    lossless=True,
)
@dataclass(eq=False)
class PromptLookupDecoder(Decoder):
    """Lossless prompt-lookup decoding with a carried Jacobi chain.

    lookup_tokens: the longest draft; max_match / min_match: n-gram sizes tried, longest first;
    jacobi_drafts: how many of the last forward's predictions past its accepted tokens are refined
    again as a Jacobi chain (0: none).
    """

    lookup_tokens: int = option(10, "lookup: longest n-gram draft", AT_LEAST_ONE)
    max_match: int = option(3, "lookup: longest n-gram matched", AT_LEAST_ONE)
    min_match: int = option(2, "lookup: shortest n-gram matched", AT_LEAST_ONE)
    jacobi_drafts: int = option(0, "lookup: carried predictions refined as a Jacobi chain", NON_NEGATIVE)
    sampler: Sampler = sampling()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_match > self.max_match:
            raise FastForwardError(f"min match ({self.min_match}) must be <= max match ({self.max_match})")

    def begin(self, session: Session, rows: Sequence[int]) -> None:
        first = first_tokens(session, rows)
        for index in rows:
            row = session.rows[index]
            ngrams = NgramIndex(self.max_match, self.min_match)
            ngrams.extend([*row.prefix, first[index]])
            row.state = LookupState(ngrams, first[index], DraftLength(self.lookup_tokens))

    def step(self, session: Session) -> None:
        if session.batch == 1:  # one row: its draft as a candidate beside a Jacobi chain (`verify`)
            self._step_alone(session)
        else:
            self._step_batch(session)

    def _step_alone(self, session: Session) -> None:
        state: LookupState = session.rows[0].state
        want = state.length.next()
        draft = state.index.draft(want) if want else []
        (verdict,) = verify(session, [state.last], [state.chain], [[draft] if draft else []], tail=0)
        state.index.extend(verdict.committed)
        state.last = verdict.committed[-1]
        if draft:
            state.length.update(len(draft), verdict.accepted if verdict.winner == 1 else 0)
        state.chain = verdict.ahead[: self.jacobi_drafts]

    def _step_batch(self, session: Session) -> None:
        """Rows of a batch: each row's draft, then its carried predictions and repeats of its last token
        up to the longest draft, as one causal chain per row (a draft token past a row's own draft is
        a guess like any other: accepted only where it is the prediction)."""
        states: list[LookupState] = [row.state for row in session.rows]
        running = [not row.finished for row in session.rows]
        bound = row_tokens(session)  # under the server's bound, shorter drafts (0: an AR step)
        longest = self.lookup_tokens if bound is None else max(0, bound - 1)
        drafts = []
        for state, runs in zip(states, running, strict=True):
            want = min(state.length.next(), longest) if runs else 0
            drafts.append(state.index.draft(want) if want else [])
        n = max(len(d) for d in drafts)
        filled = [(d + s.chain + [s.last] * n)[:n] for d, s in zip(drafts, states, strict=True)]
        guesses, accepted = chain_step(session, [s.last for s in states], filled)
        for state, runs, draft, guess, a in zip(states, running, drafts, guesses, accepted, strict=True):
            if not runs:
                continue
            committed = guess[: a + 1]
            state.index.extend(committed)
            state.last = committed[-1]
            if draft:
                state.length.update(len(draft), min(a, len(draft)))
            state.chain = guess[a + 1 :][: self.jacobi_drafts]
