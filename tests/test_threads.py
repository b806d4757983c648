"""Thread choice (`fastforward.cpu.threads`): other work is read from CPU times, ours left out, without waiting
when the command's own start-up already gave a long enough sample."""

import os
import threading
import time

import pytest

from fastforward.cpu import threads


def test_auto_threads_is_sane():
    assert 0.0 <= threads.busy_cores(interval=0.05) <= (os.cpu_count() or 1)
    assert 1 <= threads.auto_threads() <= (os.cpu_count() or 1)


def test_other_work_is_the_machines_busy_time_less_our_own(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sysconf", lambda name: 100)  # jiffies per second
    start = threads.Sample(wall=time.monotonic() - 1, machine=(1000, 600), own=1.0)
    # 400 jiffies over 2 cores: 2 s; 300 of them busy, 100 of those (1 s) ours: one other core busy
    monkeypatch.setattr(threads, "_cpu_times", lambda: (1400, 700))
    monkeypatch.setattr(threads, "_own_cpu", lambda: 2.0)
    monkeypatch.setattr(time, "sleep", lambda seconds: pytest.fail("a sample of 1 s needs no waiting"))
    assert threads.busy_cores(since=start) == pytest.approx(1.0)
    assert threads.auto_threads(since=start) == 1


def test_a_short_sample_waits_for_the_rest(monkeypatch):
    waited = []
    monkeypatch.setattr(time, "sleep", waited.append)
    threads.busy_cores(since=threads.Sample.now())
    assert len(waited) == 1 and 0 < waited[0] <= threads.MIN_SAMPLE


def test_on_passing_thread_runs_work_elsewhere_and_leaves_no_thread():
    """The work runs off the calling thread, on one that has ended when its result comes back (its
    OpenMP pool goes with it), and the calling thread gets the work's exception as raised."""
    seen = []
    assert threads.on_passing_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fails() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        threads.on_passing_thread(fails)


def test_load_ready_loads_and_warms_up_on_a_thread_that_ends(tmp_path, monkeypatch, capsys):
    """The servers' "load, then warm up" (`serve`, `engine run`, Ray replicas): both on a passing thread,
    the warm-up with the decoder given (None: none), said in two lines when a program is named."""
    from fastforward.api import build_decoder
    from fastforward.model import Model
    from fastforward.model.tiny import tiny_model
    from fastforward.serving import warm_up

    tiny_model(seed=0).save(tmp_path / "model")
    load = {"name_or_path": str(tmp_path / "model")}
    seen = []
    monkeypatch.setattr(
        warm_up, "warm_up", lambda model, decoder: seen.append((threading.current_thread(), decoder)) or 2
    )
    jacobi = build_decoder("jacobi")
    assert isinstance(warm_up.load_ready(load, jacobi, "fastforward test"), Model)
    [(thread, decoder)] = seen
    assert decoder is jacobi and thread is not threading.current_thread() and not thread.is_alive()
    assert capsys.readouterr().out.splitlines() == [
        "fastforward test: warming up",
        "fastforward test: warmed up in 2 s",
    ]
    assert isinstance(warm_up.load_ready(load, None, "fastforward test"), Model) and len(seen) == 1
    assert warm_up.load_ready(load, jacobi) is not None and len(seen) == 2 and capsys.readouterr().out == ""
