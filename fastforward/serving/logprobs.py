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
from fastforward.model.cache import KVCache


@dataclass
class Scores:
    """Per token of `ids[start:]`: its log-probability and the `top` most likely (id, log-probability)."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


# Positions whose logits one scoring forward returns: 1024 x SmolLM2's 49,152-entry vocabulary is 200 MB
# in float32. A longer text (an echoed prompt) is scored in pieces of this many tokens over a cache.
SCORE_ROWS = 1024


def score(model: Model, ids: list[int], start: int, top: int) -> Scores:
    """log p(ids[i] | ids[:i]) for i >= start (start >= 1): one causal forward without a cache, or for
    more than `SCORE_ROWS` such tokens, the text before them and then pieces of them over a cache."""
    if len(ids) <= start:
        return Scores([], [], [])
    inputs, first = ids[:-1], start - 1  # inputs[first + j] predicts ids[start + j]
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    with torch.inference_mode():
        cache = model.new_cache() if len(inputs) - first > SCORE_ROWS else None
        pieces = [(0, len(inputs))] if cache is None else [(0, first)] * (first > 0)
        if cache is not None:
            pieces += [(b, min(b + SCORE_ROWS, len(inputs))) for b in range(first, len(inputs), SCORE_ROWS)]
        for begin, end in pieces:
            logits = _forward(model, inputs[begin:end], begin, cache, keep=max(0, end - max(begin, first)))
            if logits is None:
                continue
            logp = torch.log_softmax(logits.float(), dim=-1)
            target = torch.tensor(ids[max(begin, first) + 1 : end + 1], device=logp.device)
            chosen += logp.gather(1, target[:, None])[:, 0].tolist()
            if top:
                best = logp.topk(top, dim=-1)
                pairs = zip(best.indices.tolist(), best.values.tolist(), strict=True)
                tops += [list(zip(i, v, strict=True)) for i, v in pairs]
            else:
                tops += [[] for _ in range(len(target))]
    return Scores(ids[start:], chosen, tops)


def _forward(model: Model, tokens: list[int], begin: int, cache: KVCache | None, keep: int) -> torch.Tensor | None:
    """The logits [keep, V] of the last `keep` of `tokens` (at positions from `begin`), after `cache`'s."""
    ids = torch.tensor([tokens], device=model.device)
    positions = torch.arange(begin, begin + len(tokens), device=model.device)[None]
    cached = {model.cache_argument: cache.hf, "use_cache": True} if cache is not None else {"use_cache": False}
    out = model.hf(input_ids=ids, position_ids=positions, logits_to_keep=max(keep, 1), **cached)
    return out.logits[0] if keep else None


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
