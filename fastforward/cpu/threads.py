"""How many torch threads to use: the cores other work leaves free.

On a shared machine extra threads make small-matrix work many times slower (they wait on each other
for cores that are busy): two torch jobs on 2 cores with 2 threads each fell to 0.52 tok/s, where
one thread each gave 34 tok/s. Every command therefore picks its thread count from the free cores
unless `--threads` says otherwise.
"""

from __future__ import annotations

import os
import time

import torch


def busy_cores(interval: float = 0.2) -> float:
    """How many cores other work keeps busy right now.

    Linux: the non-idle share of /proc/stat's CPU time over `interval` seconds. Elsewhere: the
    1-minute load average, which lags (just after `pip install` it still counts the install)."""
    cores = os.cpu_count() or 1
    try:
        before = _cpu_times()
        time.sleep(interval)
        after = _cpu_times()
        total, idle = after[0] - before[0], after[1] - before[1]
        return cores * (1 - idle / total) if total > 0 else 0.0
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:  # not available on this platform
            return 0.0


def _cpu_times() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the machine, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def auto_threads() -> int:
    """Torch threads for small models: the cores not already busy (at least 1, at most all of them).

    On a shared machine extra threads make small-matrix work many times slower (they wait on each
    other), so a busy machine gets one thread; a free one gets every core."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, int(cores - busy_cores() + 0.5)))


def use_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads`, or when None/0 to `auto_threads()`; returns the count."""
    count = threads or auto_threads()
    torch.set_num_threads(count)
    return count
