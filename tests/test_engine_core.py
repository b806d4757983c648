"""The engine core (`decoding.engine_core`): every caller's loop. Requests in any order and batch size
give the tokens each gives alone; finished rows leave the batch at the step they finish; stop strings
cut the text; an aborted request ends between steps; a failure is raised in process and isolated in a
server."""

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.decoding import scheduler
from fastforward.decoding.engine_core import EngineCore, Request, generate, in_order
from fastforward.decoding.runtime import GenerationInterrupted, Session
from fastforward.errors import FastForwardError

LOSSLESS = [("ar", {}), ("jacobi", {"block_size": 3}), ("lookup", {}), ("sbd-verified", {"block_size": 3})]


def alone(tiny, decoder, prompts, budget):
    return [decoder.generate(tiny, [p], budget)[0].token_ids for p in prompts]


@pytest.mark.parametrize("name, knobs", LOSSLESS, ids=[n for n, _ in LOSSLESS])
@pytest.mark.parametrize("batch_size", [1, 2, None])
def test_any_batch_size_gives_each_prompt_its_tokens_alone(tiny, prompts, name, knobs, batch_size):
    decoder = build_decoder(name, **knobs)
    budgets = [3, 17, 9, 12]  # mixed: rows finish at different steps, and waiting prompts take their places
    got = generate(tiny, decoder, prompts, budgets, batch_size=batch_size)
    assert [g.token_ids for g in got] == [
        decoder.generate(tiny, [p], b)[0].token_ids for p, b in zip(prompts, budgets, strict=True)
    ]
    assert [g.stats.tokens for g in got] == [len(g.token_ids) for g in got]


def test_a_finished_row_leaves_the_batch_at_the_step_it_finishes(tiny, prompts):
    """Each forward runs the rows still decoding only: a row that finished costs nothing after its step."""
    decoder = build_decoder("jacobi", block_size=3)
    widths = []
    forward = Session.forward

    def counted(self, tokens, *args, **kwargs):
        widths.append((tokens.shape[0], [row.finished for row in self.rows]))
        return forward(self, tokens, *args, **kwargs)

    core = EngineCore(tiny, scheduler.Limits(8, None, 10**6))
    requests = [
        core.add_request(Request(p, decoder, b, stream_text=False))
        for p, b in zip(prompts[:3], [2, 20, 8], strict=True)
    ]
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Session, "forward", counted)
        while core.has_work:
            core.step()
    assert all(not any(finished) for _, finished in widths)  # no forward ever carried a finished row
    assert [rows for rows, _ in widths][0] == 3 and [rows for rows, _ in widths][-1] == 1
    for request, budget in zip(requests, [2, 20, 8], strict=True):
        assert request.generation.token_ids == decoder.generate(tiny, [request.prompt], budget)[0].token_ids


def test_stop_strings_cut_the_text_in_process_as_in_a_server(tiny, prompts):
    decoder = build_decoder("ar")
    whole = decoder.generate(tiny, [prompts[1]], 24)[0]
    stop = whole.text[len(whole.text) // 2 :][:3]
    assert stop and stop in whole.text
    cut = generate(tiny, decoder, [prompts[1]], 24, stop=[stop])[0]
    assert cut.text == whole.text[: whole.text.index(stop)] and cut.finish_reason == "stop"
    assert whole.token_ids[: len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < len(whole.token_ids)


def test_text_increments_add_up_to_the_text(tiny, prompts):
    core = EngineCore(tiny)
    request = core.add_request(Request(prompts[2], build_decoder("jacobi", block_size=4), 30))
    deltas = []
    with torch.inference_mode():
        while core.has_work:
            deltas += [out.delta for out in core.step() if out.request is request]
    assert "".join(deltas) == request.generation.text and len([d for d in deltas if d]) > 1


def test_an_aborted_request_ends_between_steps(tiny, prompts):
    core = EngineCore(tiny, scheduler.Limits(1, None, 10**6))  # one row at a time: the second one waits
    running, waiting = (core.add_request(Request(p, build_decoder("ar"), 30)) for p in prompts[:2])
    with torch.inference_mode():
        core.step()
        core.step()
        EngineCore.abort(running)
        EngineCore.abort(waiting)
        ended = {out.request.id: out.generation.finish_reason for out in core.step() if out.finished}
    assert ended == {running.id: "cancelled", waiting.id: "cancelled"}
    assert 0 < len(running.generation.token_ids) < 30 and waiting.generation.token_ids == []
    assert not core.has_work


def test_a_failure_is_raised_in_process_and_ends_only_its_batch_in_a_server(tiny, prompts, monkeypatch):
    def broken(self, session):
        raise RuntimeError("boom")

    jacobi = build_decoder("jacobi", block_size=3)
    monkeypatch.setattr(type(jacobi), "step", broken)
    with pytest.raises(RuntimeError, match="boom"):
        generate(tiny, jacobi, prompts[:2], 8)
    core = EngineCore(tiny, isolate_failures=True)
    failing = core.add_request(Request(prompts[0], jacobi, 8))
    fine = core.add_request(Request(prompts[1], build_decoder("ar"), 8))
    outputs = []
    with torch.inference_mode():
        while core.has_work:
            outputs += core.step()
    errors = {out.request.id: out.error for out in outputs if out.error}
    assert errors == {failing.id: "decoding failed: RuntimeError: boom"}
    assert fine.generation.token_ids == build_decoder("ar").generate(tiny, [prompts[1]], 8)[0].token_ids


def test_in_order_yields_each_prompt_once_those_before_it_are_done(tiny, prompts, monkeypatch):
    """Ctrl-C mid-way: the prompts already given stay given; the rest come with what they had."""
    decoder = build_decoder("ar")
    steps = []
    advance = Session.advance

    def interrupted(self, keep):
        steps.append(1)
        if len(steps) == 12:
            raise KeyboardInterrupt
        return advance(self, keep)

    monkeypatch.setattr(Session, "advance", interrupted)
    given = []
    with pytest.raises(GenerationInterrupted) as caught:
        for generation in in_order(tiny, decoder, prompts, [4, 30, 30, 30], batch_size=2):
            given.append(generation)
    rest = caught.value.generations
    assert len(given) + len(rest) == len(prompts) and len(given) >= 1
    assert rest[0].finish_reason == "interrupted" and rest[-1].token_ids == []  # the last one never started


def test_bad_requests_are_refused_when_added(tiny, prompts):
    core = EngineCore(tiny)
    with pytest.raises(FastForwardError, match="max_new_tokens must be > 0"):
        core.add_request(Request(prompts[0], build_decoder("ar"), 0))
    with pytest.raises(FastForwardError, match="no prompts given"):
        generate(tiny, build_decoder("ar"), [], 4)


def test_every_step_runs_under_inference_mode_whoever_calls_it(tiny, prompts, monkeypatch):
    """The server's worker calls `step` from a plain thread: autograd must be off inside (it halved the
    server's tokens/s when it was not)."""
    ar = build_decoder("ar")
    seen = []
    step = type(ar).step

    def noting(self, session):
        seen.append(torch.is_inference_mode_enabled())
        return step(self, session)

    monkeypatch.setattr(type(ar), "step", noting)
    core = EngineCore(tiny)
    core.add_request(Request(prompts[0], ar, 4))
    assert not torch.is_inference_mode_enabled()
    while core.has_work:
        core.step()
    assert seen and all(seen)
