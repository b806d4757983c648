"""Log-probabilities of the tokens a request committed, for every decoder, in OpenAI's and vLLM's shapes.

Decoders commit tokens in many ways (drafts verified, masks revealed, sets accepted), and some never
see the distribution a token came from. So the server scores the text afterwards: one plain causal
forward of prompt + completion gives log p(token | everything before it) for every token, the raw
model distribution (no temperature or top-p), as vLLM returns it by default. One forward costs about
as much as the request's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastforward.model import Model


@dataclass
class Scores:
    """Per token of `ids[start:]`: its log-probability and the `top` most likely (id, log-probability)."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def score(model: Model, ids: list[int], start: int, top: int) -> Scores:
    """log p(ids[i] | ids[:i]) for i >= start (start >= 1), from one causal forward without a cache."""
    count = len(ids) - start
    if count <= 0:
        return Scores([], [], [])
    with torch.inference_mode():
        tokens = torch.tensor([ids[:-1]], device=model.device)
        positions = torch.arange(len(ids) - 1, device=model.device)[None]
        logits = model.hf(input_ids=tokens, position_ids=positions, use_cache=False, logits_to_keep=count).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(ids[start:], device=logp.device)
        chosen = logp.gather(1, target[:, None])[:, 0].tolist()
        best = logp.topk(top, dim=-1) if top else None
    tops = [[] for _ in range(count)]
    if best is not None:
        tops = [list(zip(i, v, strict=True)) for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
    return Scores(ids[start:], chosen, tops)


def kept_tokens(model: Model, ids: list[int], text: str) -> list[int]:
    """The completion's tokens that its returned text comes from: all of them, unless a stop string cut
    the text, then those that begin before its end (the stop token, which adds no text, stays)."""
    if len(model.decode(ids)) <= len(text):
        return ids
    kept, length = [], 0
    for token in ids:
        if length >= len(text):
            break
        kept.append(token)
        length = len(model.decode(kept))
    return kept


def _piece(model: Model, token: int) -> str:
    return model.tokenizer.decode([token])


def completion_logprobs(model: Model, scores: Scores, offset: int, first: int | None = None) -> dict[str, Any]:
    """vLLM's `logprobs` of a completion choice: tokens, token_logprobs, top_logprobs (a dict per token,
    the chosen token included), text_offset. `first`: a token before the scored ones (echo: the
    prompt's first), whose log-probability is null."""
    ids = ([first] if first is not None else []) + scores.ids
    pieces = [_piece(model, t) for t in ids]
    offsets = []
    for token in ids:
        offsets.append(offset)
        offset += len(model.decode([token]))
    tops: list[dict[str, float] | None] = [None] if first is not None else []
    for token, logprob, top in zip(scores.ids, scores.logprobs, scores.top, strict=True):
        entry = {_piece(model, token): logprob}  # the chosen token first: tokens of equal text do not hide it
        for other, value in top:
            entry.setdefault(_piece(model, other), value)
        tops.append(entry)
    logprobs = ([None] if first is not None else []) + scores.logprobs
    return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(model: Model, scores: Scores) -> dict[str, Any]:
    """OpenAI's `logprobs` of a chat choice: per token its text, log-probability, UTF-8 bytes and top."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = _piece(model, token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    content = [
        {**entry(token, logprob), "top_logprobs": [entry(t, v) for t, v in top]}
        for token, logprob, top in zip(scores.ids, scores.logprobs, scores.top, strict=True)
    ]
    return {"content": content, "refusal": None}
