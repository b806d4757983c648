"""Decoder equalities: AR vs transformers, SBD vs AR, batch vs single, and the cache after decoding."""

import pytest
import torch
from driving import decode

from fastforward.decoding.decoders import (
    ARDecoder,
    JacobiDecoder,
    SBDDecoder,
    Session,
    VerifiedSBDDecoder,
    multiblock_jacobi,
)
from fastforward.decoding.decoders.mbd import MultiBlockDiffusionDecoder
from fastforward.decoding.decoders.multiblock_jacobi import MultiBlockJacobiDecoder
from fastforward.decoding.policies import EntropyBounded
from fastforward.decoding.runtime import start
from fastforward.decoding.sampling import Sampler

INF = float("inf")


def _ids(gens):
    return [g.token_ids for g in gens]


def test_ar_greedy_equals_transformers_generate(tiny, prompts):
    for prompt in prompts:
        ours = ARDecoder().generate(tiny, [prompt], max_new_tokens=24)[0].token_ids
        with torch.inference_mode():
            ref = tiny.hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=tiny.stop_token_ids
            )
        assert ours == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "decoder", [ARDecoder(), SBDDecoder(4, EntropyBounded(1.0)), SBDDecoder(3, EntropyBounded(INF))]
)
def test_batch_equals_one_at_a_time(tiny, prompts, decoder):
    batched = _ids(decoder.generate(tiny, prompts, max_new_tokens=17))
    single = [decoder.generate(tiny, [p], max_new_tokens=17)[0].token_ids for p in prompts]
    assert batched == single


def test_sbd_block_of_one_with_ntp_first_token_is_ar(tiny, prompts):
    ar = _ids(ARDecoder().generate(tiny, prompts, max_new_tokens=20))
    sbd = SBDDecoder(1, EntropyBounded(0.0), first_token_from_ntp=True).generate(tiny, prompts, max_new_tokens=20)
    assert _ids(sbd) == ar
    assert all(g.stats.nfe == 19 for g in sbd)  # the first token comes from the prefill


def test_gamma_zero_reveals_one_token_per_forward(tiny, prompts):
    gens = SBDDecoder(8, EntropyBounded(0.0)).generate(tiny, prompts, max_new_tokens=20)
    for g in gens:
        assert g.stats.tokens_per_step == {1: 20}
        assert g.stats.nfe == 20


def test_gamma_infinite_reveals_whole_block_per_forward(tiny, prompts):
    gens = SBDDecoder(8, EntropyBounded(INF)).generate(tiny, prompts, max_new_tokens=20)
    for g in gens:
        assert g.stats.tokens_per_step == {8: 2, 4: 1}  # 20 = 8 + 8 + 4
        assert g.stats.nfe == 3
        assert g.stats.tpf == pytest.approx(20 / 3)


def test_cache_after_sbd_equals_fresh_prefill(tiny, prompts, cache_is_prefill):
    prompt = prompts[0]
    decoder = SBDDecoder(5, EntropyBounded(2.0))
    with torch.inference_mode():
        session = start(tiny, [prompt], 23)
        decode(decoder, session)
    generated = session.rows[0].output
    committed = len(generated) - 3  # 23 = 5·4 + 3: the last block is read, not yet committed
    assert session.cache.get_seq_length() == len(prompt) + committed
    cache_is_prefill(session.cache, prompt + generated[:committed])


@pytest.mark.parametrize(
    "decoder",
    [
        ARDecoder(),
        SBDDecoder(4, EntropyBounded(INF)),
        SBDDecoder(6, EntropyBounded(1.5), first_token_from_ntp=True),
        VerifiedSBDDecoder(4, EntropyBounded(1.0)),
        VerifiedSBDDecoder(16, EntropyBounded(INF)),
        MultiBlockDiffusionDecoder(4, 2, 0.0, 0.5),
        MultiBlockDiffusionDecoder(6, 3, 0.2, 0.3, 0.3),
    ],
)
def test_stop_token_inside_a_block_ends_generation(tiny, prompts, decoder, stop_on):
    free = decoder.generate(tiny, [prompts[1]], max_new_tokens=30)[0].token_ids
    stop = free[9]
    with stop_on(stop):
        gen = decoder.generate(tiny, [prompts[1]], max_new_tokens=30)[0]
    cut = free.index(stop) + 1
    assert gen.token_ids == free[:cut] and gen.finish_reason == "stop"
    assert gen.stats.tokens == cut


class _ScriptedOrder:
    """A reveal policy for tests: one position per forward, the first still masked in `order`."""

    def __init__(self, order: list[int]):
        self.order = order

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        reveal = torch.zeros_like(masked)
        for row in range(masked.shape[0]):
            pick = next((i for i in self.order if masked[row, i]), None)
            if pick is not None:
                reveal[row, pick] = True
        return reveal


def test_sbd_spends_no_forward_after_a_revealed_stop(tiny, prompts, stop_on):
    """Position 2 is revealed first and holds a stop token: position 5 (after it) is never revealed,
    so the block ends after revealing positions 0 and 1, in three forwards."""
    decoder = SBDDecoder(8, _ScriptedOrder([2, 5, 0, 1, 3, 4, 6, 7]))
    free = decoder.generate(tiny, [prompts[0]], max_new_tokens=8)[0].token_ids
    assert free[2] not in free[:2]
    with stop_on(free[2]):
        gen = decoder.generate(tiny, [prompts[0]], max_new_tokens=8)[0]
    assert gen.token_ids[2] == free[2] and len(gen.token_ids) == 3
    assert gen.stats.nfe == 3  # revealing position 5 first would have cost a fourth


def test_sampling_is_reproducible_by_seed(tiny, prompts):
    def run(seed):
        dec = SBDDecoder(4, EntropyBounded(1.0), sampler=Sampler(temperature=1.0, top_p=0.9, seed=seed))
        return _ids(dec.generate(tiny, prompts[:2], max_new_tokens=12))

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("decoder", [SBDDecoder(4, EntropyBounded(0.5)), VerifiedSBDDecoder(4, EntropyBounded(0.5))])
def test_max_new_tokens_is_respected_mid_block(tiny, prompts, decoder):
    for n in (1, 5, 7):
        gens = decoder.generate(tiny, prompts, max_new_tokens=n)
        assert all(len(g.token_ids) == n for g in gens)


# ---- SBD drafts verified by next-token prediction ---------------------------------------------------
@pytest.mark.parametrize(("block", "gamma"), [(1, 0.5), (2, 0.0), (3, 0.5), (5, INF), (8, 0.5), (16, 2.0), (16, INF)])
def test_verified_sbd_equals_greedy_ar(tiny, prompts, block, gamma):
    ar = _ids(ARDecoder().generate(tiny, prompts, max_new_tokens=33))
    decoder = VerifiedSBDDecoder(block, EntropyBounded(gamma))
    assert _ids(decoder.generate(tiny, prompts, max_new_tokens=33)) == ar  # batched, with holes
    assert [decoder.generate(tiny, [p], max_new_tokens=33)[0].token_ids for p in prompts] == ar


@pytest.mark.parametrize(("block", "gamma"), [(8, 0.0), (16, 0.0), (16, 0.1)])
def test_verified_sbd_never_falls_below_one_token_per_forward(tiny, prompts, block, gamma):
    """The tiny model's masked path is untrained, so drafts keep failing verification; forwards
    that only reveal must not push TPF below 1 (the output stays greedy AR's)."""
    ar = _ids(ARDecoder().generate(tiny, prompts, max_new_tokens=40))
    decoder = VerifiedSBDDecoder(block, EntropyBounded(gamma))
    for gens in (
        decoder.generate(tiny, prompts, max_new_tokens=40),
        [decoder.generate(tiny, [p], 40)[0] for p in prompts],
    ):
        assert _ids(gens) == ar
        assert all(g.stats.tokens >= g.stats.nfe for g in gens), [(g.stats.tokens, g.stats.nfe) for g in gens]
    assert any(0 in g.stats.tokens_per_step for g in gens)  # drafting forwards did happen


class _OracleDrafts(VerifiedSBDDecoder):
    """Drafts the true continuation (one row), so every draft is accepted."""

    def __init__(self, truth: list[int], block_size: int):
        super().__init__(block_size)
        self.truth = truth

    def _reveal(self, session, logits, candidates, own):
        start, draft = session.rows[0].state.start, session.rows[0].state.draft  # draft[0]: the last token output
        for j, candidate in enumerate(candidates[0][: len(draft)]):
            if candidate and start + j < len(self.truth):
                draft[j] = self.truth[start + j]


@pytest.mark.parametrize("block", [3, 8])
def test_verified_sbd_commits_accepted_drafts_and_keeps_an_exact_cache(tiny, prompts, block, decode_and_check_cache):
    prompt = prompts[1]
    truth = ARDecoder().generate(tiny, [prompt], max_new_tokens=40)[0].token_ids
    session = decode_and_check_cache(_OracleDrafts(truth, block), prompt, 40)
    assert session.rows[0].output == truth
    # one forward drafts the first block; then each forward verifies a whole block and drafts the next
    assert session.rows[0].forwards == 1 + -(-(len(truth) - 1) // block)


@pytest.mark.parametrize("init", ["repeat", "random"])
@pytest.mark.parametrize("block", [1, 3, 8, 16])
def test_jacobi_equals_greedy_ar(tiny, prompts, block, init):
    ar = _ids(ARDecoder().generate(tiny, prompts, max_new_tokens=33))
    jacobi = JacobiDecoder(block, init)
    assert _ids(jacobi.generate(tiny, prompts, max_new_tokens=33)) == ar  # batched, with holes
    assert [jacobi.generate(tiny, [p], max_new_tokens=33)[0].token_ids for p in prompts] == ar


def test_jacobi_stats_are_consistent(tiny, prompts):
    """Every forward yields at least one token; the histogram accounts for all but the prefill's token."""
    ar = ARDecoder().generate(tiny, [prompts[0]], max_new_tokens=40)[0]
    jac = JacobiDecoder(8, "repeat").generate(tiny, [prompts[0]], max_new_tokens=40)[0]
    assert jac.token_ids == ar.token_ids
    assert jac.stats.nfe <= ar.stats.nfe
    assert min(jac.stats.tokens_per_step) >= 1
    assert sum(jac.stats.tokens_per_step.values()) == jac.stats.nfe
    assert sum(k * v for k, v in jac.stats.tokens_per_step.items()) == jac.stats.tokens - 1


@pytest.mark.parametrize("decoder", [JacobiDecoder(4), JacobiDecoder(16, "random")])
def test_jacobi_stops_inside_a_block(tiny, prompts, decoder, stop_on):
    free = ARDecoder().generate(tiny, [prompts[2]], max_new_tokens=30)[0].token_ids
    with stop_on(free[11]):
        gen = decoder.generate(tiny, [prompts[2]], max_new_tokens=30)[0]
    assert gen.token_ids == free[: free.index(free[11]) + 1]


def test_random_drafts_do_not_depend_on_the_rows_slot_in_its_batch(tiny, prompts, monkeypatch):
    """`jacobi --draft-init random` draws a row's drafts from its own seed and each slot's position: a
    request feeds the same forwards (so takes as many) wherever it sits in a batch."""
    fed: list[dict[tuple[int, ...], list[int]]] = []  # per forward: what each running row fed, by prompt
    forward = Session.forward

    def spy(session, tokens, *args, **kwargs):
        rows = zip(session.rows, tokens.tolist(), strict=True)
        fed.append({tuple(row.prefix): line for row, line in rows if not row.finished})
        return forward(session, tokens, *args, **kwargs)

    monkeypatch.setattr(Session, "forward", spy)

    def run(batch: list[list[int]]) -> tuple[list[list[int]], list[int], int]:
        fed.clear()
        generation = JacobiDecoder(4, "random").generate(tiny, batch, max_new_tokens=24)[batch.index(prompts[0])]
        mine = [step[tuple(prompts[0])] for step in fed if tuple(prompts[0]) in step]
        return mine, generation.token_ids, generation.stats.nfe

    alone = run([prompts[0]])
    assert run([prompts[1], prompts[0]]) == alone
    assert run([prompts[2], prompts[3], prompts[0]]) == alone


def test_cache_after_jacobi_equals_fresh_prefill(tiny, prompts, decode_and_check_cache):
    # everything but the last committed token (it rides in front of the next forward) is cached,
    # and verified tokens past max_new_tokens may follow
    decode_and_check_cache(JacobiDecoder(6), prompts[3], 25)


@pytest.mark.parametrize(("block", "blocks", "verify"), [(1, 1, 0), (4, 2, 2), (16, 3, 4), (5, 2, 1)])
def test_multiblock_jacobi_equals_greedy_ar(tiny, prompts, block, blocks, verify):
    ar = _ids(ARDecoder().generate(tiny, prompts, max_new_tokens=40))
    decoder = MultiBlockJacobiDecoder(block, blocks, spawn_ratio=0.25, verify=verify)
    assert _ids(decoder.generate(tiny, prompts, max_new_tokens=40)) == ar


@pytest.mark.parametrize("block", [3, 8])
def test_multiblock_jacobi_never_drafts_fewer_than_plain_jacobi(tiny, prompts, block, monkeypatch):
    # a real-active block that shrinks as it commits would verify fewer drafts than plain Jacobi
    lengths: list[int] = []
    original = multiblock_jacobi.verify

    def recording(session, lasts, drafts, cands, tail):
        lengths.extend(len(d) for d in drafts if d)  # the running rows' (a finished row's are empty)
        return original(session, lasts, drafts, cands, tail)

    plain = JacobiDecoder(block).generate(tiny, prompts, max_new_tokens=40)
    monkeypatch.setattr(multiblock_jacobi, "verify", recording, raising=True)
    out = MultiBlockJacobiDecoder(block, max_blocks=1, verify=0).generate(tiny, prompts, max_new_tokens=40)
    assert set(lengths) == {block}
    assert [(g.token_ids, g.stats.nfe) for g in out] == [(g.token_ids, g.stats.nfe) for g in plain]


class _OracleRecycling(MultiBlockJacobiDecoder):
    """Seeds the n-gram pool with the true continuation, so recycled candidates win verification."""

    def __init__(self, truth, **kw):
        super().__init__(**kw)
        self.truth = truth

    def new_pool(self):
        pool = super().new_pool()
        pool.add_rejected(self.truth, 0, self.ngram)
        return pool


def test_recycled_candidates_are_committed_losslessly(tiny, prompts, decode_and_check_cache):
    prompt = prompts[0]
    truth = ARDecoder().generate(tiny, [prompt], max_new_tokens=40)[0].token_ids
    assert len(set(truth)) > 1
    # entries were moved from the candidates' slots
    session = decode_and_check_cache(_OracleRecycling(truth, block_size=4, max_blocks=1, verify=3, ngram=6), prompt, 40)
    assert session.rows[0].output == truth
    assert session.rows[0].forwards < len(truth) / 3  # candidates of 6 confirmed tokens win
