"""The decoding runtime: canvas commits in any order, stop rules, segment prefill, per-row keep, the step protocol."""

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.decoding import prefill
from fastforward.decoding.decoders import ARDecoder
from fastforward.decoding.prefill import prefill_chunks
from fastforward.decoding.rows import Status, make_rows
from fastforward.decoding.runtime import Prompt, Session, start
from fastforward.decoding.sampling import Sampler
from fastforward.decoding.steps import append, commit_writes, span
from fastforward.errors import FastForwardError
from fastforward.model import Layout, visibility


@pytest.fixture(autouse=True)
def _inference():
    """Decoding runs under inference mode; so do these tests (sessions hold inference tensors)."""
    with torch.inference_mode():
        yield


def _session(tiny, prompts, max_new_tokens=8) -> Session:
    return start(tiny, prompts, max_new_tokens)


def _commit(session: Session, tokens: list[int], at: list[int]) -> None:
    commit_writes(session, [list(zip(at, tokens, strict=True))])


def _outputs(session: Session) -> list[list[int]]:
    return [row.output for row in session.rows]


def _free_tokens(tiny) -> list[int]:
    """Four ids that are not stop tokens."""
    stops = set(tiny.stop_token_ids)
    return [t for t in range(10, 40) if t not in stops][:4]


# ---- canvas -------------------------------------------------------------------------------------
def test_out_of_order_commits_fill_the_canvas_by_position(tiny, prompts):
    session = _session(tiny, [prompts[0]])
    a, b, c, d = _free_tokens(tiny)
    _commit(session, [d, b], [3, 1])
    assert _outputs(session) == [[]] and session.rows[0].frontier == 0  # position 0 is still open
    _commit(session, [a], [0])
    assert _outputs(session) == [[a, b]] and span(session, 0, 1).tolist() == [[len(prompts[0]) + 2]]
    _commit(session, [c], [2])
    assert _outputs(session) == [[a, b, c, d]] and not session.finished


def test_a_stop_token_ends_a_row_only_once_everything_before_it_is_committed(tiny, prompts):
    session = _session(tiny, [prompts[0]])
    a, b, c, _ = _free_tokens(tiny)
    stop = tiny.stop_token_ids[0]
    _commit(session, [stop, c], [2, 4])  # a stop at 2 and a token after it
    assert not session.finished
    _commit(session, [a], [0])
    assert not session.finished
    _commit(session, [b], [1])
    assert session.finished and _outputs(session) == [[a, b, stop]]  # cut at the stop token
    _commit(session, [c], [3])  # a finished row takes no more tokens
    assert _outputs(session) == [[a, b, stop]] and session.rows[0].canvas[3] is None


def test_the_budget_ends_a_row_and_nothing_is_written_past_it(tiny, prompts):
    session = _session(tiny, [prompts[1]], max_new_tokens=3)
    tokens = _free_tokens(tiny)
    append(session, [tokens])  # four tokens, room for three
    assert session.finished and _outputs(session) == [tokens[:3]]


def test_batched_rows_finish_independently(tiny, prompts):
    session = _session(tiny, prompts[:2], max_new_tokens=4)
    a, b, c, d = _free_tokens(tiny)
    append(session, [[a, b, c, d], [a, b, c, d]], [4, 2])
    assert [row.finished for row in session.rows] == [True, False]
    append(session, [[a, a], [c, d]])
    assert _outputs(session) == [[a, b, c, d], [a, b, c, d]] and session.finished


# ---- prefill of segments ------------------------------------------------------------------------
def _causal_cache(tiny, tokens: list[int], positions: list[int]):
    cache = tiny.new_cache()
    n = len(tokens)
    with torch.inference_mode():
        logits = tiny.run(
            Layout(torch.tensor([tokens]), torch.tensor([positions]), visibility.causal(n)[None], torch.arange(n)),
            cache,
        )
    return cache, logits


def test_infilling_prefill_equals_a_causal_prefill_of_prefix_and_suffix(tiny, prompts):
    prefix, suffix, gap = prompts[0], prompts[1], 5
    rows = [Prompt(prefix, suffix, gap), Prompt(prompts[3], prompts[2][:3], 2)]  # different lengths: padded
    session = _session(tiny, rows)
    assert [row.limit for row in session.rows] == [gap, 2]
    for r, row in enumerate(rows):
        tokens = [*row.prefix, *row.suffix]
        p = len(row.prefix)
        positions = [*range(p), *range(p + row.gap, p + row.gap + len(row.suffix))]
        fresh, logits = _causal_cache(tiny, tokens, positions)
        n = len(tokens)
        real = session.cache.key_valid[r].nonzero()[:, 0]
        assert len(real) == n
        for a, b in zip(fresh.layers, session.cache.layers, strict=True):
            torch.testing.assert_close(b.keys[r : r + 1, :, real], a.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(b.values[r : r + 1, :, real], a.values, rtol=1e-4, atol=1e-4)
        # next_logits: what follows the prefix (the suffix comes later in causal order, unseen)
        torch.testing.assert_close(session.next_logits[r], logits[0, p - 1], rtol=1e-4, atol=1e-4)


def test_prefill_chunks_group_similar_lengths_within_a_budget():
    assert prefill_chunks([5], 64) == [[0]]
    assert prefill_chunks([7, 5, 6], 64) == [[0, 1, 2]]  # one chunk: the rows in their order
    assert prefill_chunks([6, 400, 8, 300, 20], 2048) == [[0, 2, 4], [3, 1]]  # short and long apart
    assert prefill_chunks([30] * 5, 64) == [[0, 1], [2, 3], [4]]  # at most 64 padded tokens each
    assert prefill_chunks([100, 5], 64) == [[1], [0]]  # a prompt over the budget alone


@pytest.mark.parametrize("budget", [prefill.PREFILL_TOKENS, 24])
def test_prompts_of_very_different_lengths_prefill_in_chunks_as_they_would_alone(tiny, prompts, budget, monkeypatch):
    """Chunks (by the lengths, and by the budget) are separate forwards whose caches are stacked back
    in row order: each row's logits and valid cache entries are its prompt's alone, and so is its output."""
    monkeypatch.setattr(prefill, "PREFILL_TOKENS", budget)
    rows = [prompts[3], prompts[2] * 2, prompts[0], prompts[1] * 2, prompts[3] + prompts[0]]
    chunks = prefill_chunks([len(r) for r in rows], budget)
    assert len(chunks) > 1
    forwards = []
    run = tiny.run
    monkeypatch.setattr(tiny, "run", lambda layout, cache: forwards.append(layout.tokens.shape) or run(layout, cache))
    session = _session(tiny, rows)
    assert [shape[0] for shape in forwards] == [len(c) for c in chunks]
    for r, row in enumerate(rows):
        alone = _session(tiny, [row])
        # float32 GEMMs of other shapes round differently: 1.4e-5 apart once on an AVX2-only EPYC (tokens: below)
        torch.testing.assert_close(session.next_logits[r], alone.next_logits[0], rtol=1e-4, atol=5e-5)
        valid = session.cache.key_valid[r]
        assert int(valid.sum()) == len(row)
        for mine, theirs in zip(session.cache.layers, alone.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys[r][:, valid], theirs.keys[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.values[r][:, valid], theirs.values[0], rtol=1e-5, atol=1e-5)
    outputs = [g.token_ids for g in ARDecoder().generate(tiny, rows, 12)]
    assert outputs == [ARDecoder().generate(tiny, [row], 12)[0].token_ids for row in rows]


def test_an_infilling_prompt_fills_exactly_its_gap(tiny, prompts):
    gens = build_decoder("setdlm").generate(tiny, [Prompt(prompts[0], prompts[1], 6)], max_new_tokens=50)
    assert len(gens[0].token_ids) <= 6 and gens[0].stats.tokens == len(gens[0].token_ids)
    with pytest.raises(FastForwardError, match="cannot infill"):  # AR would read a suffix it was never trained on
        ARDecoder().generate(tiny, [Prompt(prompts[0], prompts[1], 6)], max_new_tokens=50)


def test_an_infilling_prompt_needs_a_gap():
    with pytest.raises(FastForwardError, match="gap"):
        Prompt([1, 2], [3], 0)


# ---- what to keep -------------------------------------------------------------------------------
def _step(session: Session, tokens: torch.Tensor, keep) -> torch.Tensor:
    positions = span(session, 0, tokens.shape[1])
    logits = session.forward(tokens, positions, read=range(tokens.shape[1]))
    session.advance(keep)
    return logits


@pytest.mark.parametrize(
    "keep",
    [
        torch.tensor([[True, False, True], [False, True, False]]),  # not prefixes: entries are moved
        torch.tensor([[True, True, False], [True, False, False]]),  # prefixes of different lengths: holes
    ],
)
def test_rows_that_keep_different_entries_decode_as_they_would_alone(tiny, prompts, keep):
    rows = [prompts[0], prompts[2]]
    new = torch.tensor([[11, 12, 13], [21, 22, 23]])
    follow = torch.tensor([[31, 32], [41, 42]])
    batched = _session(tiny, rows)
    _step(batched, new, keep)
    together = _step(batched, follow, 2)
    for r, prompt in enumerate(rows):
        alone = _session(tiny, [prompt])
        _step(alone, new[r : r + 1], keep[r : r + 1])
        torch.testing.assert_close(together[r : r + 1], _step(alone, follow[r : r + 1], 2), rtol=1e-4, atol=1e-4)


def test_kept_entries_equal_a_causal_prefill_of_the_kept_tokens(tiny, prompts):
    """Keeping entries 0 and 2 of [a, b, c] when b is invisible to c (a candidate layout) leaves
    the cache of a causal prefill of prompt + [a, c]."""
    prompt = prompts[1]
    session = _session(tiny, [prompt])
    rule = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with torch.inference_mode():
        n = len(prompt)
        positions = torch.tensor([[n, n + 1, n + 1]])
        session.forward(torch.tensor([[50, 51, 52]]), positions, rule, read=range(3))
        session.advance(torch.tensor([[True, False, True]]))
    fresh, _ = _causal_cache(tiny, [*prompt, 50, 52], [*range(n), n, n + 1])
    for a, b in zip(fresh.layers, session.cache.layers, strict=True):
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)


# ---- the step protocol --------------------------------------------------------------------------
def test_a_step_must_be_closed_before_the_next_forward(tiny, prompts):
    session = _session(tiny, [prompts[0]])
    token = torch.tensor([[5]])
    with torch.inference_mode():
        session.forward(token, span(session, 0, 1), read=range(1))
        with pytest.raises(RuntimeError, match="advance"):
            session.forward(token, span(session, 0, 1), read=range(1))
        session.advance(1)
        with pytest.raises(RuntimeError, match="no step is open"):
            session.advance(1)


def test_stats_count_forwards_per_row_and_tokens_per_step(tiny, prompts):
    session = _session(tiny, prompts[:2], max_new_tokens=6)
    a, b, c, _ = _free_tokens(tiny)
    session.rows[1].finish(Status.CANCELLED)  # a finished row takes no part in a forward
    with torch.inference_mode():
        session.forward(torch.tensor([[a, b], [a, b]]), span(session, 0, 2), read=range(2))
        append(session, [[a, b, c], [a, b, c]], [3, 1])
        session.advance(0)
    assert [row.forwards for row in session.rows] == [1, 0]
    assert [row.steps for row in session.rows] == [{3: 1}, {}]  # the second row took no part in that forward
    assert [row.queries for row in session.rows] == [2, 0]  # the two tokens of the forward it took part in


def test_a_rows_status_is_one_field_from_waiting_to_why_it_ended(tiny, prompts):
    """Made, a row waits; prefilled, it runs; its own commits finish it with its reason, and `finish`
    ends it from outside between steps (a cancelled row commits nothing more)."""
    assert [row.status for row in make_rows(tiny, prompts[:3], 3, Sampler())] == [Status.WAITING] * 3
    session = _session(tiny, prompts[:3], max_new_tokens=3)
    assert [row.status for row in session.rows] == [Status.RUNNING] * 3
    a, b, c, _ = _free_tokens(tiny)
    stop = tiny.stop_token_ids[0]
    session.rows[2].finish(Status.CANCELLED)
    append(session, [[a, b, c], [a, stop], [a, b, c]])
    assert [row.status for row in session.rows] == [Status.LENGTH, Status.STOP, Status.CANCELLED]
    assert [row.finish_reason for row in session.rows] == ["length", "stop", "cancelled"]
    assert session.rows[2].output == [] and session.finished
    session.rows[0].finish(Status.CANCELLED)  # a finished row keeps its reason
    assert session.rows[0].status is Status.LENGTH


def test_ar_runs_one_query_per_forward(tiny, prompts):
    stats = ARDecoder().generate(tiny, prompts[:1], max_new_tokens=12)[0].stats
    assert stats.queries == stats.nfe and stats.queries_per_token == stats.nfe / stats.tokens
    assert stats.as_dict()["queries"] == stats.nfe


# ---- per-row limits and why a row stopped -------------------------------------------------------
def test_each_row_has_its_own_limit_and_says_why_it_stopped(tiny, prompts):
    long_prompt = (prompts[2] * 60)[: tiny.max_context - 5]  # room for 5 new tokens
    gens = ARDecoder().generate(tiny, [prompts[1], long_prompt], max_new_tokens=12)
    assert gens[1].finish_reason == "context" and len(gens[1].token_ids) == 5
    alone = ARDecoder().generate(tiny, [prompts[1]], max_new_tokens=12)[0]
    assert gens[0].token_ids == alone.token_ids  # the long prompt does not cap the short one
    assert gens[0].finish_reason == alone.finish_reason
    assert alone.finish_reason == ("stop" if alone.token_ids[-1] in tiny.stop_token_ids else "length")


def test_finish_reason_stop(tiny, prompts, stop_on):
    free = ARDecoder().generate(tiny, [prompts[0]], max_new_tokens=10)[0]
    with stop_on(free.token_ids[3]):
        gen = ARDecoder().generate(tiny, [prompts[0]], max_new_tokens=10)[0]
    assert gen.finish_reason == "stop" and len(gen.token_ids) <= 4
    assert ARDecoder().generate(tiny, [prompts[0]], max_new_tokens=2)[0].finish_reason == "length"


def test_generate_json_reports_finish_reason_and_warns_on_context_cuts(tmp_path, capsys):
    import json

    from fastforward.cli import main
    from fastforward.model.tiny import tiny_model

    path = tmp_path / "tiny"
    tiny_model(seed=0, init_std=0.5, max_positions=24).save(path)
    args = ["generate", "--model", str(path), "--dtype", "float32", "--no-chat-template", "--json"]
    assert main([*args, "--max-new-tokens", "40", "def add(a, b): return a + b"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.splitlines()[0])
    # a 24-position model after an 18-token prompt: 6 new tokens, then the context is full
    assert record["finish_reason"] == "context" and len(record["token_ids"]) == 6
    assert "context cut" in err
