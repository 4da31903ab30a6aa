"""Memory a kspipe job process keeps: the C library's malloc arenas, as many as the cores
a process may use, not eight a core; and Paddle's executor, serial, freeing what its
operators leave behind a megabyte at a time.

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

Each program's executor hands the tensors its operators leave behind to a thread of its
own, which frees them and then spins, waiting for more.  By default it is handed each
tensor as it dies: every operator wakes it, and on a machine whose cores the job's
processes share, those threads took the cores from the work (a parameter-server job of the
classifier plugin, 2 workers and a server on 2 cores: 8% of the machine spinning, and
more in the kernel waking threads).  Given dead tensors ~1 MB at a time
(``FLAGS_eager_delete_tensor_gb``), the same job ran ~40% faster and a local one ~15%; a
Reptile run kept its speed and its numbers, with 5-15 MB more at its peak
(BENCHMARKS.md, "Paddle's garbage collector, a megabyte at a time").
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENA_ENV = "MALLOC_ARENA_MAX"  # the user's own cap, which glibc read at the process's start
SERIAL_ENV = "FLAGS_new_executor_serial_run"  # read by Paddle when it loads
FREE_ENV = "FLAGS_eager_delete_tensor_gb"  # likewise
#: kspipe's defaults for them
EXECUTOR_DEFAULTS = {
    SERIAL_ENV: "1",  # operators on the thread that runs the program
    FREE_ENV: "0.001",
}  # dead tensors freed a megabyte at a time


def cap_arenas(env=os.environ) -> bool:
    """Cap this process's malloc arenas at its cores (at least two), before its threads
    start; nothing where the user set ``MALLOC_ARENA_MAX`` (in ``env``, this process's
    environment) or the C library is not glibc.  Returns whether the cap was set."""
    if env.get(ARENA_ENV):
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


def executor_defaults(env=os.environ) -> None:
    """Paddle's executor as kspipe runs it, set in ``env`` (this process's environment,
    before Paddle loads): operators on the calling thread, dead tensors freed a megabyte at
    a time (:data:`EXECUTOR_DEFAULTS`), each unless the user set it."""
    for name, value in EXECUTOR_DEFAULTS.items():
        env.setdefault(name, value)
