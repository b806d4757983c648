"""Sliding SBD: γ = 0 is AR (greedy and sampled), rows are independent, the cache is a prefill's."""

from __future__ import annotations

import math

import pytest
import torch
from driving import decode

from fastforward.api import build_decoder
from fastforward.decoding.decoders import ARDecoder, Prompt
from fastforward.decoding.decoders.sbd_slide import SlidingSBDDecoder
from fastforward.decoding.runtime import start
from fastforward.decoding.sampling import Sampler
from fastforward.errors import FastForwardError


def test_gamma_zero_is_greedy_ar_one_token_a_forward(tiny, prompts):
    gens = SlidingSBDDecoder(6, 0.0).generate(tiny, prompts, max_new_tokens=12)
    ar = ARDecoder().generate(tiny, prompts, max_new_tokens=12)
    assert [g.token_ids for g in gens] == [g.token_ids for g in ar]
    assert all(g.stats.tokens_per_step == {1: len(g.token_ids)} for g in gens)


def test_gamma_inf_accepts_whole_blocks_and_a_batch_equals_one_at_a_time(tiny, prompts):
    decoder = SlidingSBDDecoder(4, math.inf)
    batched = decoder.generate(tiny, prompts, max_new_tokens=13)
    single = [decoder.generate(tiny, [p], max_new_tokens=13)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    assert [g.stats.nfe for g in batched] == [g.stats.nfe for g in single]
    assert all(len(g.token_ids) == 13 or g.token_ids[-1] in tiny.stop_token_ids for g in batched)
    full = [g for g in single if len(g.token_ids) == 13]
    assert full and all(g.stats.nfe == math.ceil(13 / 4) for g in full)


@pytest.mark.parametrize("gamma", [0.5, math.inf])
def test_the_cache_holds_a_causal_prefill_of_the_text(tiny, prompts, cache_is_prefill, gamma):
    for prompt in prompts:
        with torch.inference_mode():
            session = start(tiny, [prompt], 11)
            decode(SlidingSBDDecoder(5, gamma), session)
        cached = session.cache.get_seq_length()
        assert cached > len(prompt)
        cache_is_prefill(session.cache, (prompt + session.rows[0].output)[:cached])


def test_sampled_at_gamma_zero_is_sampled_ar(tiny, prompts):
    sampler = Sampler(temperature=1.0, top_p=0.75)
    rows = [Prompt(p, seed=s) for s, p in enumerate(prompts)]
    gens = SlidingSBDDecoder(3, 0.0, sampler=sampler).generate(tiny, rows, 12)
    assert [g.token_ids for g in gens] == [g.token_ids for g in ARDecoder(sampler).generate(tiny, rows, 12)]


def test_bad_settings_are_clear(tiny):
    with pytest.raises(FastForwardError, match="at least 2"):
        build_decoder("sbd-slide", block_size=1)
    with pytest.raises(FastForwardError, match="gamma"):
        build_decoder("sbd-slide", block_size=4, gamma=-1.0)
