"""Where this process stands in a launch of several (`torchrun`, `accelerate launch`), read from the
environment the launcher sets, so that a command knows it before any process group forms: only process
0 prints, and an error is reported once."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable

import torch
from accelerate.utils import get_cpu_distributed_information

from fastforward.errors import FastForwardError

REPORT_WAIT_S = 60  # how long a process other than 0 waits for process 0 to report an error they share


def launch_rank() -> int:
    """This process's rank in its launch (0 when it runs alone)."""
    return get_cpu_distributed_information().rank


def launched_processes() -> int:
    """How many processes the launch started (1 when this one runs alone)."""
    return get_cpu_distributed_information().world_size


def local_rank() -> int:
    """This process's rank among the launch's processes on this machine: the GPU it takes."""
    return get_cpu_distributed_information().local_rank


def share_threads(threads: int | None) -> None:
    """Under a launch of several processes on this machine, give each its share of the cores: `threads`
    (--threads), else OMP_NUM_THREADS (torchrun sets 1 unless told otherwise), else the cores over the
    processes. (Each alone would take all the free cores, and threads waiting for busy cores are many
    times slower.)"""
    local = get_cpu_distributed_information().local_world_size
    if threads is None and local > 1:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // local)))


def say(message: str) -> None:
    """Print on process 0 only: a launch of N processes says everything once."""
    if launch_rank() == 0:
        print(message, flush=True)


def reported_once(run: Callable[..., int]) -> Callable[..., int]:
    """A command's `run` whose FastForwardError process 0 alone reports (the CLI prints it); the others
    wait for process 0's exit to end the launch, and themselves with it."""

    @functools.wraps(run)
    def wrapper(*args, **kwargs) -> int:
        try:
            return run(*args, **kwargs)
        except FastForwardError as exc:
            if launch_rank() == 0:
                raise
            # Exiting first would let the launcher stop process 0 before it says why. An error of this
            # process alone is said here once the wait is over.
            time.sleep(REPORT_WAIT_S)
            print(f"process {launch_rank()}: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return wrapper
