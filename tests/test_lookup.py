"""Prompt-lookup drafts: the n-gram index, lossless output, and drafts that pay or cost nothing."""

import pytest

from fastforward.api import build_decoder
from fastforward.decoding.decoders import ARDecoder
from fastforward.decoding.decoders import lookup as lookup_module
from fastforward.decoding.decoders.lookup import DraftLength, NgramIndex, PromptLookupDecoder
from fastforward.errors import FastForwardError


def test_index_drafts_what_followed_the_longest_recent_match():
    index = NgramIndex(max_match=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    assert index.draft(2) == [4, 9]  # the longest match, "1 2 3", was followed by 4 9
    index.extend([8, 2, 3])
    assert index.draft(2) == [8, 2]  # "8 2 3" is new; the latest "2 3" (in "1 2 3") was followed by 8
    index.extend([6])
    assert index.draft(4) == []  # "6" was never seen before
    index = NgramIndex(max_match=2, min_match=2)
    index.extend([4, 8, 4])
    assert index.draft(3) == []  # a one-token match is too short here


@pytest.mark.parametrize("knobs", [{}, {"jacobi_drafts": 4}, {"lookup_tokens": 3, "max_match": 1, "min_match": 1}])
def test_lookup_equals_greedy_ar(tiny, prompts, knobs):
    decoder = build_decoder("lookup", **knobs)
    for prompt in prompts:
        ar = ARDecoder().generate(tiny, [prompt], max_new_tokens=50)[0]
        assert decoder.generate(tiny, [prompt], max_new_tokens=50)[0].token_ids == ar.token_ids


def test_no_match_means_one_token_forwards(tiny, prompts, monkeypatch):
    """Without a draft (the index stubbed to find none) every step is an AR step: AR's forwards, one query each."""
    monkeypatch.setattr(lookup_module.NgramIndex, "draft", lambda index, length: [])
    for prompt in prompts:
        ar = ARDecoder().generate(tiny, [prompt], max_new_tokens=40)[0]
        out = PromptLookupDecoder().generate(tiny, [prompt], max_new_tokens=40)[0]
        assert out.token_ids == ar.token_ids
        assert (out.stats.nfe, out.stats.queries) == (ar.stats.nfe, ar.stats.queries) == (ar.stats.nfe, ar.stats.nfe)


def test_good_drafts_are_committed_losslessly_and_bad_ones_cost_a_forward(
    tiny, prompts, decode_and_check_cache, monkeypatch
):
    prompt = prompts[0]
    truth = ARDecoder().generate(tiny, [prompt], max_new_tokens=40)[0].token_ids

    def oracle(index, length):  # the true continuation, with every fifth drafted token wrong
        done = len(index.text) - len(prompt)
        draft = truth[done : done + length]
        return [t if (done + i) % 5 else (t + 1) % 200 for i, t in enumerate(draft)]

    monkeypatch.setattr(lookup_module.NgramIndex, "draft", oracle)
    ran = []  # tokens of each decoding forward
    run = tiny.run
    monkeypatch.setattr(tiny, "run", lambda layout, cache: ran.append(layout.tokens.shape[1]) or run(layout, cache))
    session = decode_and_check_cache(PromptLookupDecoder(lookup_tokens=8), prompt, 40)
    assert session.rows[0].output == truth
    assert session.rows[0].forwards < len(truth) / 2
    # every draft token was a query of some forward, the rejected ones included
    decoding = ran[1:-1]  # not the prefill, nor the fresh prefill the cache is checked against
    assert session.rows[0].queries == sum(decoding) and sum(decoding) > len(truth)


def test_bad_knobs_are_refused():
    with pytest.raises(FastForwardError, match="min match"):
        build_decoder("lookup", min_match=4, max_match=2)
    with pytest.raises(FastForwardError, match="lookup tokens"):
        build_decoder("lookup", lookup_tokens=0)


def test_draft_length_grows_shrinks_and_pauses_after_failed_one_token_drafts():
    length = DraftLength(10)
    length.update(10, 10)
    assert length.next() == 10  # capped at the longest
    length.update(10, 4)
    assert length.next() == 9  # one shorter after a partial accept
    for want in (4, 2, 1):  # halved while nothing is right
        length.update(length.next(), 0)
        assert length.next() == want
    pauses = []
    for _ in range(6):  # one-token drafts keep failing: drafting pauses 1, 2, 4, 8, 16, 16 steps
        length.update(1, 0)
        skipped = 0
        while (want := length.next()) == 0:
            skipped += 1
        pauses.append(skipped)
        assert want == 1
    assert pauses == [1, 2, 4, 8, 16, 16]
    length.update(1, 1)  # an accepted token ends the backing off
    length.update(3, 0)
    length.update(1, 0)
    assert [length.next(), length.next()] == [0, 1]
