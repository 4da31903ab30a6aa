"""Memory a kspipe job process keeps: the C library's malloc arenas, as many as the cores
a process may use, not eight a core; and Paddle's executor, serial.

glibc gives a thread that allocates an arena of its own, up to eight per core, and memory
freed in an arena stays with it.  A Reptile run has many threads that allocate (Paddle's
executor threads, four per program and lane, the lanes themselves, task sampling), so each
holds its own share of freed memory: capped at the cores, a run of 200 meta-iterations of
the default experiment peaked at 1.47-1.49 GB instead of 1.76-1.80 GB, at the same speed
(BENCHMARKS.md, "Peak memory of a Reptile run"; measured before the executor was made
serial, below, which took the executor's threads away).

Paddle's executor runs each program's operators on four threads of its own, and its oneDNN
kernels cache what they build per thread: a Reptile run held a copy for each.  Serial
(``FLAGS_new_executor_serial_run``), the operators run on the thread that calls the
executor: 100 meta-iterations and their evaluations peaked at 0.94-0.95 GB instead of
1.55-1.57 GB, 5-15% faster, to the same numbers; the default experiment at 0.93 GB.  A
workload that runs programs on several threads must keep each executor on one thread
(:mod:`kspipe.reptile.lanes`, docs/plugins.md).
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENA_ENV = "MALLOC_ARENA_MAX"  # the user's own cap, which glibc read at the process's start
SERIAL_ENV = "FLAGS_new_executor_serial_run"  # read by Paddle when it loads


def cap_arenas() -> bool:
    """Cap this process's malloc arenas at its cores (at least two), before its threads
    start; nothing where the user set ``MALLOC_ARENA_MAX`` or the C library is not glibc.
    Returns whether the cap was set."""
    if os.environ.get(ARENA_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt: not glibc
        return False
    return bool(mallopt(M_ARENA_MAX, max(2, len(os.sched_getaffinity(0)))))


def threaded_executor() -> None:
    """Paddle's threaded executor in this process from now on: for a model served to
    requests that arrive on several threads, which then all run its one executor."""
    import paddle

    paddle.set_flags({SERIAL_ENV: False})


def serial_executor() -> None:
    """Paddle's executor runs operators on the calling thread in this process, unless the
    user set ``FLAGS_new_executor_serial_run``; before Paddle loads."""
    os.environ.setdefault(SERIAL_ENV, "1")
