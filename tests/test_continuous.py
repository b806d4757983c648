"""Continuous batching: rows join a running session and leave it between steps (`Session.join`, prefilled
by the caller, and `Session.leave`); every registered decoder's outputs equal its outputs alone, and the
cache equals a fresh prefill of each running row's tokens after any sequence of joins and leaves."""

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.decoding.decoders import ARDecoder, JacobiDecoder, Prompt, registry
from fastforward.decoding.decoders.lookup import PromptLookupDecoder
from fastforward.decoding.decoders.sbd_verified import VerifiedSBDDecoder
from fastforward.decoding.policies import EntropyBounded
from fastforward.decoding.rows import Status
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import row_tokens
from fastforward.model import Layout
from fastforward.model.cache import KVCache

# (step at which the request arrives, prompt index, budget): staggered, mixed budgets, two at once
ARRIVALS = [(0, 0, 12), (0, 1, 5), (2, 2, 17), (3, 3, 9), (3, 0, 7), (9, 1, 14), (10, 2, 3)]

# Knob values for the tiny model, given to every registered decoder that takes them: blocks of a few
# tokens, and bounds loose enough that its untrained masks reveal or accept several tokens a forward.
TINY_KNOBS = {
    "block_size": 4,
    "window": 3,
    "threshold": 0.5,
    "gamma": 1.0,
    "lookup_tokens": 4,
    "max_match": 2,
    "min_match": 1,
    "jacobi_drafts": 2,
}


def registered(**knobs) -> list:
    """Every registered decoder, built with the `TINY_KNOBS` (and `knobs`) it takes: a new decoder is
    held to these tests without editing them."""
    params = []
    for name, spec in registry.specs().items():
        chosen = {k: v for k, v in {**TINY_KNOBS, **knobs}.items() if spec.knob(k)}
        params.append(pytest.param(spec.create(**chosen), id=name))
    return params


# Settings of some decoders that take other paths: random drafts, first tokens from the NTP head, and
# verified SBD drafts that keep failing (rows out of credit draft at once).
VARIANTS = [
    pytest.param(build_decoder("jacobi", block_size=3, draft_init="random"), id="jacobi-random"),
    pytest.param(build_decoder("sbd-slide", block_size=4, gamma=3.0), id="sbd-slide-long-runs"),
    pytest.param(build_decoder("setdlm", window=3, threshold=0.5, first_token_from_ntp=True), id="setdlm-ntp-first"),
    pytest.param(build_decoder("sbd", block_size=3, gamma=0.5, first_token_from_ntp=True), id="sbd-ntp-first"),
    pytest.param(build_decoder("sbd-verified", block_size=3, gamma=0.1), id="sbd-verified-broke"),
]


def _check_cache(tiny, session) -> None:
    """Every running row's valid cache entries are a causal prefill of its prompt and its first
    committed tokens (as many as it has entries beyond the prompt; what it has not cached yet, the
    next forward carries), and the cache's buffers are laid out as fresh ones are: compiled steps guard
    on their strides (a view past dropped entries ran eagerly)."""
    for layer in session.cache.layers:
        assert layer.key_buffer.is_contiguous() and layer.value_buffer.is_contiguous()
    valid = session.cache.validity(session.batch)
    for index, row in enumerate(session.rows):
        if row.finished:
            continue
        cached = int(valid[index].sum()) - len(row.prefix)
        assert 0 <= cached <= row.frontier
        ids = row.prefix + row.canvas[:cached]
        fresh = tiny.new_cache()
        n = len(ids)
        with torch.inference_mode():
            tiny.run(Layout(torch.tensor([ids]), torch.arange(n)[None], None), fresh)
        for a, b in zip(fresh.layers, session.cache.layers, strict=True):
            keys, values = b.keys[index][:, valid[index]], b.values[index][:, valid[index]]
            torch.testing.assert_close(keys, a.keys[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(values, a.values[0], rtol=1e-4, atol=1e-4)


def run_staggered(model, decoder, prompts, arrivals, check=None, fused=False, samplers=None):
    """Decode requests arriving at the given steps in one session; returns each request's tokens.
    fused: finished rows stay until the next arrivals, which drop them as they join (`join(drop=...)`),
    all the arrivals of a step in one join with their own budgets. samplers: each request's own."""
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    outputs: dict[int, list[int]] = {}
    session, step = None, 0
    with torch.inference_mode():
        while pending or (session is not None and session.batch):
            arrived = [(i, a) for i, a in pending if a[0] <= step]
            pending = [(i, a) for i, a in pending if a[0] > step]
            done = [] if session is None else [index for index, row in enumerate(session.rows) if row.finished]
            for index in done:
                outputs[session.rows[index].owner] = session.rows[index].output
            if arrived:
                rows = [
                    Prompt(prompts[index], seed=request, sampler=samplers[request] if samplers else None)
                    for request, (_, index, _) in arrived
                ]
                budgets = [budget for _, (_, _, budget) in arrived]
                if session is None:
                    session, new = decoder.open_session(model, rows, budgets), list(range(len(rows)))
                elif fused:
                    new, done = session.join(*decoder.prefilled(model, rows, budgets), drop=done), []
                else:
                    new = session.join(*decoder.prefilled(model, rows, budgets))
                decoder.begin(session, new)
                for index, (request, _) in zip(new, arrived, strict=True):
                    session.rows[index].owner = request  # the row's request: joins and leaves keep it
            if done:
                session.leave(done)
            if session is not None and not session.finished:
                decoder.step(session)
                if check:
                    check(session)
            elif session is not None and not pending:
                for index, row in enumerate(session.rows):
                    outputs[row.owner] = session.rows[index].output
                break
            step += 1
    return [outputs[i] for i in range(len(arrivals))]


@pytest.mark.parametrize("decoder", registered() + VARIANTS)
@pytest.mark.parametrize("slack", [64, 0], ids=["holes-kept", "repacked"])
@pytest.mark.parametrize("fused", [False, True], ids=["leave", "drop-on-join"])
def test_staggered_rows_give_their_outputs_alone(tiny, prompts, decoder, slack, fused, monkeypatch):
    """With slack 0 every leave or join repacks the cache (each row's kept entries squeezed together).
    A decoder whose cache is not a causal prefill (plain setdlm caches its tokens in reveal order) has
    only its outputs compared."""
    monkeypatch.setattr(KVCache, "SQUEEZE_SLACK", slack)
    check = (lambda s: _check_cache(tiny, s)) if decoder.causal_cache else None
    got = run_staggered(tiny, decoder, prompts, ARRIVALS, check=check, fused=fused)
    alone = [decoder.generate(tiny, [prompts[index]], budget)[0].token_ids for _, index, budget in ARRIVALS]
    assert got == alone


def test_sampled_rows_are_reproducible_whatever_joins(tiny, prompts):
    """A request's seed makes its samples its own: the same as alone, however rows come and go."""
    decoder = JacobiDecoder(4, sampler=Sampler(temperature=0.8, seed=3))
    got = run_staggered(tiny, decoder, prompts, ARRIVALS)
    alone = [
        decoder.generate(tiny, [Prompt(prompts[index], seed=request)], budget)[0].token_ids
        for request, (_, index, budget) in enumerate(ARRIVALS)
    ]
    assert got == alone


# each request's own temperature and top-p, greedy among them: one batch, every row as alone
OWN_SAMPLERS = [Sampler(0.8), Sampler(), Sampler(1.3, 0.9), Sampler(0.8, 0.5), Sampler(), Sampler(1.0), Sampler(2.0)]


@pytest.mark.parametrize("decoder", registered())
def test_rows_with_their_own_samplers_sample_as_alone(tiny, prompts, decoder):
    got = run_staggered(tiny, decoder, prompts, ARRIVALS, samplers=OWN_SAMPLERS)
    alone = [
        decoder.generate(tiny, [Prompt(prompts[index], seed=request, sampler=OWN_SAMPLERS[request])], budget)[0]
        for request, (_, index, budget) in enumerate(ARRIVALS)
    ]
    assert got == [generation.token_ids for generation in alone]
    mixed = run_staggered(tiny, decoder, prompts, ARRIVALS)  # the session's sampler (greedy) for every row
    assert mixed != got  # the rows' own samplers were used


@pytest.mark.parametrize("joining", [1, 2], ids=["one-for-one", "fewer-than-dropped"])
def test_rows_joining_in_dropped_rows_places_write_only_their_own_entries(tiny, prompts, joining):
    """As many rows (or fewer) join as leave: they take the dropped rows' places (a finished one and a
    cancelled one), their entries are written over those rows' in the running buffers (the staying
    row is not copied: same storage), further dropped rows leave, and every row decodes as it would
    alone; a new row in a cancelled row's place is not cancelled."""
    decoder = JacobiDecoder(3)
    with torch.inference_mode():
        session = decoder.open_session(tiny, [prompts[0], prompts[2], prompts[1]], [4, 30, 30])  # the longest stays
        decoder.begin(session, range(3))
        session.rows[2].finish(Status.CANCELLED)
        while not session.rows[0].finished:
            decoder.step(session)
        done = session.rows[0].output
        buffers = [layer.key_buffer.data_ptr() for layer in session.cache.layers]
        joined = [prompts[3], prompts[3][:1]][:joining]
        new = session.join(*decoder.prefilled(tiny, joined, 20), drop=[0, 2])
        assert new == ([0] if joining == 1 else [0, 2]) and session.batch == 3 - (2 - joining)
        if joining == 2:  # in place: nothing stacked, nothing left
            assert [layer.key_buffer.data_ptr() for layer in session.cache.layers] == buffers
        decoder.begin(session, new)
        _check_cache(tiny, session)
        while not session.finished:
            decoder.step(session)
            _check_cache(tiny, session)
    assert done == decoder.generate(tiny, [prompts[0]], 4)[0].token_ids
    assert session.rows[1].output == decoder.generate(tiny, [prompts[2]], 30)[0].token_ids
    for row, prompt in zip(new, joined, strict=True):
        assert session.rows[row].finish_reason != "cancelled"
        assert session.rows[row].output == decoder.generate(tiny, [prompt], 20)[0].token_ids


def test_leave_drops_padding_no_row_needs(tiny, prompts):
    decoder = ARDecoder()
    with torch.inference_mode():
        session = decoder.open_session(tiny, [prompts[2]], 4)  # the longest prompt
        decoder.begin(session, range(1))
        decoder.begin(session, session.join(*decoder.prefilled(tiny, [prompts[3]], 20)))  # the shortest: left-padded
        assert session.cache.key_valid is not None and not session.cache.key_valid[1, 0]
        while not session.rows[0].finished:
            decoder.step(session)
        session.leave([0])
        # its padding went with the other row; alone, it needs no mask (its steps are a lone prompt's)
        assert session.batch == 1 and session.cache.key_valid is None
        assert session.cache.get_seq_length() == len(prompts[3]) + len(session.rows[0].output) - 1


def test_leading_entries_no_staying_row_sees_are_dropped(tiny, prompts):
    """The longest row leaves two shorter ones: the columns only it filled go, and the buffers that
    stay are laid out as fresh ones (`_check_cache`), which compiled steps' guards need."""
    decoder = ARDecoder()
    with torch.inference_mode():
        session = decoder.open_session(tiny, [prompts[2]], 4)  # the longest prompt
        decoder.begin(session, range(1))
        decoder.begin(session, session.join(*decoder.prefilled(tiny, [prompts[3], prompts[1]], 20)))
        while not session.rows[0].finished:
            decoder.step(session)
        width = session.cache.get_seq_length()
        session.leave([0])
        assert session.batch == 2 and session.cache.get_seq_length() < width
        assert bool(session.cache.key_valid[:, 0].any())
        _check_cache(tiny, session)
        while not session.finished:
            decoder.step(session)
    alone = [decoder.generate(tiny, [prompts[i]], 20)[0].token_ids for i in (3, 1)]
    assert [row.output for row in session.rows] == alone


def test_a_row_left_alone_keeps_only_its_valid_entries_and_no_mask(tiny, prompts):
    decoder = JacobiDecoder(4)  # rejected drafts leave holes in a batch's cache
    with torch.inference_mode():
        session = decoder.open_session(tiny, [prompts[0], prompts[1]], [6, 20])
        decoder.begin(session, range(2))
        while not session.rows[0].finished:
            decoder.step(session)
        holes = int((~session.cache.key_valid[1]).sum())
        session.leave([0])
        assert holes > 0 and session.cache.key_valid is None
        _check_cache(tiny, session)
        while not session.finished:
            decoder.step(session)
        assert session.rows[0].output == decoder.generate(tiny, [prompts[1]], 20)[0].token_ids


@pytest.mark.parametrize(
    "decoder",
    [JacobiDecoder(8), PromptLookupDecoder(8, 2, 1, jacobi_drafts=2), VerifiedSBDDecoder(8, EntropyBounded(1.0))],
    ids=["jacobi", "lookup", "sbd-verified"],
)
def test_a_bound_on_a_forwards_tokens_keeps_the_outputs(tiny, prompts, decoder):
    """`Session.step_tokens` (the server's `--max-step-tokens`): a decoder drafts fewer tokens a row
    while many rows share a forward; each row's output is still its output alone."""
    with torch.inference_mode():
        session = decoder.open_session(tiny, prompts, 20)
        session.step_tokens = 9  # four rows: two tokens each, one of them a draft
        assert row_tokens(session) == 2
        decoder.begin(session, range(len(prompts)))
        while not session.finished:
            decoder.step(session)
    got = session.results()
    alone = [decoder.generate(tiny, [p], 20)[0] for p in prompts]
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    unbounded = decoder.generate(tiny, prompts, 20)
    assert sum(g.stats.queries for g in got) < sum(g.stats.queries for g in unbounded)


def test_servers_bound_a_forwards_tokens_on_a_cpu_by_default(tiny):
    from fastforward.serving.app import CPU_STEP_TOKENS, Server

    assert Server(tiny, "tiny", "jacobi", {}, max_batch_size=8).max_step_tokens == CPU_STEP_TOKENS
    assert Server(tiny, "tiny", "jacobi", {}, max_batch_size=8, max_step_tokens=40).max_step_tokens == 40
