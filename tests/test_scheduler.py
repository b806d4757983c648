"""Admission and turns (`decoding.scheduler`) as pure functions: no engine, no threads, no model."""

from dataclasses import dataclass

from fastforward.decoding.scheduler import Limits, admit, next_batch


@dataclass(eq=False)
class Waiting:
    name: str
    prompt_tokens: int = 4
    max_tokens: int = 8
    setting: str = "jacobi"
    cancelled: bool = False


def names(admitted: dict[str, list[Waiting]]) -> dict[str, list[str]]:
    return {setting: [job.name for job in jobs] for setting, jobs in admitted.items()}


def turns(waiting: list[Waiting], limits: Limits) -> list[list[str]]:
    """The jobs joining at each turn when nothing finishes meanwhile, until the queue is empty."""
    queue, running, joined = list(waiting), [], []
    while queue:
        now = [job for jobs in admit(queue, running, limits).values() for job in jobs]
        assert now, "admission stalled"
        joined.append([job.name for job in now])
        queue = [job for job in queue if job not in now]
        running += now
    return joined


def test_rows_stop_at_the_batch_size_counting_the_running_ones():
    limits = Limits(max_batch_size=3, max_batch_tokens=None, max_prefill_tokens=2048)
    waiting = [Waiting("a"), Waiting("b"), Waiting("c")]
    assert names(admit(waiting, [Waiting("r1"), Waiting("r2")], limits)) == {"jacobi": ["a"]}
    assert admit(waiting, [Waiting("r1"), Waiting("r2"), Waiting("r3")], limits) == {}
    assert names(admit(waiting, [], limits)) == {"jacobi": ["a", "b", "c"]}


def test_tokens_in_flight_count_prompt_and_budget_but_a_job_alone_always_fits():
    limits = Limits(max_batch_size=8, max_batch_tokens=40, max_prefill_tokens=2048)
    waiting = [Waiting("a", 10, 10), Waiting("b", 10, 10), Waiting("c", 1, 1)]  # 20, 20, 2 tokens
    assert names(admit(waiting, [], limits)) == {"jacobi": ["a", "b"]}
    assert names(admit(waiting, [Waiting("r", 10, 9)], limits)) == {"jacobi": ["a"]}  # 19 + 20 fits; + 20 not
    huge = [Waiting("huge", 100, 100)]
    assert names(admit(huge, [], limits)) == {"jacobi": ["huge"]}
    assert admit(huge, [Waiting("r", 1, 1)], limits) == {}


def test_a_burst_prefills_over_turns_within_the_prompt_token_budget():
    """The prompts of `test_serve`'s burst (9, 6, 20 and 1 tokens): at most the budget joins between
    two steps, one job at least, in arrival order."""
    burst = [Waiting(name, size) for name, size in zip("abcd", [9, 6, 20, 1], strict=True)]
    assert turns(burst, Limits(8, None, 2048)) == [["a", "b", "c", "d"]]
    assert turns(burst, Limits(8, None, 16)) == [["a", "b"], ["c"], ["d"]]
    assert turns(burst, Limits(8, None, 1)) == [["a"], ["b"], ["c"], ["d"]]


def test_the_first_job_that_does_not_fit_waits_and_nobody_overtakes_it():
    limits = Limits(max_batch_size=8, max_batch_tokens=None, max_prefill_tokens=10)
    waiting = [Waiting("a", 6), Waiting("long", 8), Waiting("short", 1)]
    assert names(admit(waiting, [], limits)) == {"jacobi": ["a"]}  # "short" would fit, but comes later
    limits = Limits(max_batch_size=8, max_batch_tokens=30, max_prefill_tokens=2048)
    assert names(admit([Waiting("big", 10, 20), Waiting("small", 1, 1)], [Waiting("r", 5, 5)], limits)) == {}


def test_admitted_jobs_group_by_setting_in_arrival_order():
    limits = Limits(max_batch_size=8, max_batch_tokens=None, max_prefill_tokens=2048)
    waiting = [Waiting("a", setting="ar"), Waiting("b"), Waiting("c", setting="ar"), Waiting("d")]
    admitted = admit(waiting, [], limits)
    assert names(admitted) == {"ar": ["a", "c"], "jacobi": ["b", "d"]}
    assert list(admitted) == ["ar", "jacobi"]


def test_cancelled_jobs_are_passed_over_and_take_no_room():
    limits = Limits(max_batch_size=2, max_batch_tokens=None, max_prefill_tokens=2048)
    waiting = [Waiting("gone", cancelled=True), Waiting("a"), Waiting("gone too", cancelled=True), Waiting("b")]
    assert names(admit(waiting, [], limits)) == {"jacobi": ["a", "b"]}
    assert admit([Waiting("gone", cancelled=True)], [], limits) == {}


def test_admission_changes_nothing_it_is_given():
    limits = Limits(max_batch_size=1, max_batch_tokens=None, max_prefill_tokens=2048)
    waiting, running = [Waiting("a"), Waiting("b")], [Waiting("r")]
    before = (list(waiting), list(running))
    assert admit(waiting, running, limits) == {}
    assert (waiting, running) == before


def test_settings_take_turns_one_step_each():
    assert [next_batch(["ar", "jacobi", "mbd"], turn) for turn in range(5)] == ["ar", "jacobi", "mbd", "ar", "jacobi"]
    assert [next_batch(["jacobi"], turn) for turn in range(3)] == ["jacobi"] * 3


def test_a_setting_is_the_decoders_options_as_a_value_sampling_aside():
    """Jobs share a batch when their decoders' options are equal (`Decoder.batch_key`, a hashable value):
    each row samples with its own temperature, top-p and seed, so those do not part them."""
    from fastforward.api import build_decoder

    jacobi = build_decoder("jacobi", block_size=3)
    sampled = build_decoder("jacobi", block_size=3, temperature=0.7, top_p=0.9, seed=5)
    wider = build_decoder("jacobi", block_size=4)
    assert jacobi.batch_key() == sampled.batch_key() and hash(jacobi.batch_key()) == hash(sampled.batch_key())
    assert len({jacobi.batch_key(), wider.batch_key(), build_decoder("jacobi-mr", block_size=3).batch_key()}) == 3
    assert jacobi.batch_key() != build_decoder("jacobi", block_size=3, draft_init="random").batch_key()
    sbd = build_decoder("sbd", gamma=0.2).batch_key()  # a reveal policy is a value too
    assert sbd == build_decoder("sbd", gamma=0.2).batch_key() != build_decoder("sbd", gamma=0.3).batch_key()
    waiting = [Waiting(name, setting=d.batch_key()) for name, d in zip("abc", [jacobi, wider, sampled], strict=True)]
    assert names(admit(waiting, [], Limits(8, None, 100))) == {jacobi.batch_key(): ["a", "c"], wider.batch_key(): ["b"]}
