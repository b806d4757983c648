"""How many torch threads to use (the cores other work leaves free), and which thread does torch's work.

On a shared machine extra threads make small-matrix work many times slower (they wait on each other
for cores that are busy; docs/notes/2026-11-threads-on-a-busy-machine.md). Every command therefore
picks its thread count from the free cores unless `--threads` says otherwise.

A server decodes on a thread of its own (`fastforward.serving.engine`), and must then be the only
thread with OpenMP workers: see `on_passing_thread`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

MIN_SAMPLE = 0.1  # seconds of CPU times a reading needs; a shorter one waits for the rest


def _cpu_times() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the machine, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def _own_cpu() -> float:
    """CPU seconds this process has used, all its threads."""
    times = os.times()
    return times.user + times.system


def _machine_times() -> tuple[int, int] | None:
    try:
        return _cpu_times()
    except (OSError, ValueError, IndexError):  # no /proc/stat: not Linux
        return None


@dataclass
class Sample:
    """The machine's and this process's CPU times at one moment: `busy_cores` reads other work from
    the difference to a later moment. The `fastforward` command takes one as it starts, so that its
    seconds of imports are the sample and choosing threads costs no waiting."""

    wall: float
    machine: tuple[int, int] | None  # None: no /proc/stat (not Linux)
    own: float

    @classmethod
    def now(cls) -> Sample:
        return cls(time.monotonic(), _machine_times(), _own_cpu())


def busy_cores(since: Sample | None = None, interval: float = 0.2) -> float:
    """How many cores other work keeps busy: from `since` to now (waiting until `MIN_SAMPLE` has
    passed), or over a fresh `interval` of seconds.

    Linux: the non-idle share of /proc/stat's CPU time, less what this process used itself.
    Elsewhere: the 1-minute load average, which lags (just after `pip install` it still counts the install)."""
    start = since or Sample.now()
    if start.machine is None:
        try:
            return os.getloadavg()[0]
        except OSError:  # not available on this platform
            return 0.0
    wait = (MIN_SAMPLE if since is not None else interval) - (time.monotonic() - start.wall)
    if wait > 0:
        time.sleep(wait)
    end = Sample.now()
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, idle = end.machine[0] - start.machine[0], end.machine[1] - start.machine[1]
    if total <= 0:
        return 0.0
    cores = os.cpu_count() or 1
    seconds = total / ticks / cores  # the wall time the machine's jiffies cover
    busy = (total - idle) / ticks - (end.own - start.own)
    return min(float(cores), max(0.0, busy / seconds))


def auto_threads(since: Sample | None = None) -> int:
    """Torch threads for small models: the cores not already busy (at least 1, at most all of them),
    read since `since` (see `busy_cores`).

    On a shared machine extra threads make small-matrix work many times slower (they wait on each
    other), so a busy machine gets one thread; a free one gets every core."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, int(cores - busy_cores(since) + 0.5)))


def use_threads(threads: int | None = None, since: Sample | None = None) -> int:
    """Set torch's intra-op threads to `threads`, or when None/0 to `auto_threads(since)`; returns the count."""
    import torch  # here: a `Sample` is taken before torch is imported

    count = threads or auto_threads(since)
    torch.set_num_threads(count)
    return count


def on_passing_thread(work: Callable[[], T]) -> T:
    """`work()` on a thread that ends when it returns; its result, or its exception.

    Why: libgomp (PyTorch's OpenMP) keeps a pool of worker threads for each thread that ran parallel
    work, and once its threads outnumber the cores it stops spin-waiting between parallel regions. A
    server that loaded its model on the main thread and decodes on another keeps two pools, so each of
    the hundreds of parallel regions of a decoding step waits for a sleeping worker to wake: decoding
    ran at half speed or less (`benchmarks/worker_thread.py`). Loading on a thread that ends takes its
    pool with it. The main thread waits in `join`, so a signal handler that raises (Ctrl-C, SIGTERM)
    still interrupts it; the daemon thread then dies with the process."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="fastforward-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (`platform.processor()` gives nothing on Linux), for the record
    beside a measured figure; the platform's processor string elsewhere."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
