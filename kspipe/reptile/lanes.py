"""Lanes: an executor and a scope, and the one thread that runs them off the job's thread;
how many tasks adapt side by side, and on how many lanes.

Paddle lets go of the GIL while a program runs, so lanes on threads of their own use
several cores at once.  A lane other than the model's own has a child scope of the model's
scope: it holds the slots of the tasks the lane adapts side by side, and the lane reads
the rest, theta and the optimiser state, from the model's (and writes there only
variables of its own: a training lane's share of the gather).

One executor, one thread: each lane keeps one thread for its whole life, never a pool's,
and the model's own executor runs only on the job's thread.  Paddle's oneDNN kernels cache
what they build under keys made from state an executor leaves on the thread that runs it;
under Paddle's serial executor (every kspipe job's, :mod:`kspipe.process.memory`), whose operators
run on the calling thread, executors that took turns on a pool's threads failed in oneDNN
(``RuntimeError: std::exception``), and an executor that ran one program on one thread and
another on a second crashed in a convolution's backward pass (SIGSEGV).
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

THREAD_NAME = "kspipe-lane"  # the prefix of the lanes' threads' names
_numbers = itertools.count()  # each lane's thread's name, kspipe-lane-<n>


class Lane:
    """An executor and a scope to run programs in, and its own thread to run work on; for
    a lane that adapts tasks side by side, their programs."""

    def __init__(self, executor, scope, together=None):
        self.exe = executor
        self.scope = scope
        self.together = together
        self._thread: ThreadPoolExecutor | None = None  # started by the first submit

    def submit(self, work, *args) -> Future:
        """``work(self, *args)`` on this lane's own thread, with one math thread."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, f"{THREAD_NAME}-{next(_numbers)}")
        return self._thread.submit(_on_one_math_thread, work, self, *args)

    def close(self) -> None:
        """Stop this lane's thread once its work is done; the lane is not used after."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def run(self, program, feed=None, fetch=()):
        return self.exe.run(program, feed=feed or {}, fetch_list=list(fetch), scope=self.scope)

    def set(self, name: str, value: np.ndarray) -> None:
        self.scope.find_var(name).get_tensor().set(value, self.exe.place)


def child_lane(scope, place, together) -> Lane:
    """A lane for ``together``'s programs: a new executor on ``place`` and a child scope of
    ``scope`` that holds the slot variables (the rest it reads and writes in the parent)."""
    import paddle

    child = scope.new_scope()
    # Programs look their variables up through the parent scope: what a lane writes is
    # created in its own scope first (typed, or an initialiser cannot size it), and so
    # are its feed and fetch holders.
    child.var("feed")
    child.var("fetch")
    for name in [v.name for v in together.startup.list_vars()]:
        child.var(name).get_tensor()
    lane = Lane(paddle.static.Executor(place), child, together)
    lane.submit(Lane.run, together.startup).result()
    return lane


def one_math_thread() -> None:
    """This thread's programs use one math thread: the lanes' threads are what use the
    cores (a few ms steps of small convolutions parallelise far better across tasks than
    inside one step, see BENCHMARKS.md)."""
    from paddle.base import core

    core.set_num_threads(1)


def run_on_lanes(work, lanes: list, items: list) -> list:
    """``work(lane, item)`` for each lane and its item, each on its lane's thread; the
    results in order once all finished (the first one's error, if any, raised again)."""
    return results(start_on_lanes(work, lanes, items))


def start_on_lanes(work, lanes: list, items: list) -> list[Future]:
    """``work(lane, item)`` for each lane and its item, started on its lane's thread: the
    caller's thread is free until it asks for the :func:`results`."""
    return [lane.submit(work, item) for lane, item in zip(lanes, items)]


def results(futures: list[Future]) -> list:
    """The results of ``futures`` in order once all finished (the first one's error, if
    any, raised again)."""
    wait(futures)
    return [future.result() for future in futures]


def _on_one_math_thread(work, *args):
    one_math_thread()
    return work(*args)


def tasks_together(cfg) -> tuple[int, int]:
    """How many tasks adapt side by side (1: one at a time): in meta-training, the
    meta-batch with ``train.batch_tasks`` under Reptile (FOML's last-step change stays on
    the per-task path); in evaluation, ``eval.batch_tasks`` test tasks, but no more than
    an evaluation has, when transductive (a lone query's batch stays on the per-task path).
    """
    batch_train = cfg.train.batch_tasks and cfg.train.algorithm == "reptile"
    train = cfg.train.meta_batch if batch_train else 1
    most = max(cfg.eval.tasks, cfg.eval.train_tasks, cfg.eval.interval_tasks)
    evaluation = min(cfg.eval.batch_tasks, most) if cfg.eval.transductive else 1
    return train, evaluation


#: The cores a process of a cluster may use, set by its launcher (Paddle sets OMP_NUM_THREADS
#: to 1 in every process that imports it, so that cannot tell).
THREADS_ENV = "KSPIPE_THREADS"


def thread_count(setting: int) -> int:
    """``train.threads`` / ``eval.threads``, or with 0 the cores this process is meant to
    use: its share where a cluster's launcher divided the cores among its workers, else
    every core it may run on."""
    if setting:
        return setting
    try:
        return max(1, int(os.environ.get(THREADS_ENV, "")))
    except ValueError:
        return max(1, len(os.sched_getaffinity(0)))


def train_lanes(cfg) -> list[int]:
    """The meta-batch's share of each thread that adapts it (``train.threads``), at least
    two tasks each; [] when it adapts in one thread."""
    train, _ = tasks_together(cfg)
    lanes = min(thread_count(cfg.train.threads), train // 2)
    if lanes <= 1:
        return []
    return [train // lanes + (1 if i < train % lanes else 0) for i in range(lanes)]


def train_sizes(cfg) -> list[int]:
    """The task counts meta-training adapts side by side: each lane's share, or the whole
    meta-batch (1: one task at a time)."""
    return train_lanes(cfg) or [tasks_together(cfg)[0]]


def program_sizes(cfg) -> set[int]:
    """The task counts to build side-by-side programs for."""
    return (set(train_sizes(cfg)) | {tasks_together(cfg)[1]}) - {1}
