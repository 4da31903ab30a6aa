"""Lanes: an executor and a scope for one thread each, and the threads that run them.

Paddle lets go of the GIL while a program runs, so lanes on threads of their own use
several cores at once.  A lane other than the model's own has a child scope of the model's
scope: it holds what the lane writes (the slots of the tasks it adapts side by side, and
the variables it is given to keep apart) and reads the rest, theta and the optimiser state,
from the model's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

THREAD_NAME = "kspipe-lane"  # the prefix of the lanes' threads' names


class Lane:
    """An executor and a scope to run programs in, one thread's own; for a lane that
    adapts tasks side by side, their programs and the variables it holds itself."""

    def __init__(self, executor, scope, together=None, own=()):
        self.exe = executor
        self.scope = scope
        self.together = together
        self.own = list(own)

    def run(self, program, feed=None, fetch=()):
        return self.exe.run(program, feed=feed or {}, fetch_list=list(fetch), scope=self.scope)

    def value(self, name: str) -> np.ndarray:
        return np.array(self.scope.find_var(name).get_tensor())

    def set(self, name: str, value: np.ndarray) -> None:
        self.scope.find_var(name).get_tensor().set(value, self.exe.place)


def child_lane(scope, place, together, own=()) -> Lane:
    """A lane for ``together``'s programs: a new executor on ``place`` and a child scope of
    ``scope`` that holds the slot variables and the variables ``own`` (the rest it reads
    from the parent)."""
    import paddle

    child = scope.new_scope()
    # Programs look their variables up through the parent scope: what a lane writes is
    # created in its own scope first (typed, or an initialiser cannot size it), and so
    # are its feed and fetch holders.
    child.var("feed")
    child.var("fetch")
    for name in [v.name for v in together.startup.list_vars()] + list(own):
        child.var(name).get_tensor()
    lane = Lane(paddle.static.Executor(place), child, together, own)
    lane.run(together.startup)
    return lane


def one_math_thread() -> None:
    """This thread's programs use one math thread: the lanes' threads are what use the
    cores (a few ms steps of small convolutions parallelise far better across tasks than
    inside one step, see BENCHMARKS.md)."""
    from paddle.base import core

    core.set_num_threads(1)


class LaneThreads:
    """Threads that run work on lanes, one thread per lane, one math thread each.

    A ``with`` block keeps the threads for the runs within it (nested blocks share them)
    and shuts them down when it ends, on error too; a :meth:`run` outside any block has
    threads for that run alone.
    """

    def __init__(self):
        self._pool = None
        self._holders = 0

    def __enter__(self) -> "LaneThreads":
        self._holders += 1
        return self

    def __exit__(self, *exc) -> None:
        self._holders -= 1
        if not self._holders and self._pool is not None:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True)

    def run(self, work, lanes: list, items: list) -> list:
        """``work(lane, item)`` for each lane and its item, each on a thread of its own; the
        results in order once all finished (the first one's error, if any, raised again)."""
        with self:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(len(lanes), THREAD_NAME)
            futures = [self._pool.submit(_on_one_math_thread, work, lane, item)
                       for lane, item in zip(lanes, items)]
            wait(futures)
            return [future.result() for future in futures]


def _on_one_math_thread(work, *args):
    one_math_thread()
    return work(*args)
