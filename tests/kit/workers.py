"""Workers of a job as threads of the test's process: their roles, as the sums along their
chain (kspipe.modes.summing) and to the servers' summers (kspipe.modes.ps.sharded) ask
them, and the sum in worker order those must equal bit for bit."""

from __future__ import annotations

import threading

import numpy as np


class Workers:
    """``count`` workers' roles in threads of this process; ``all_gather`` meets at a
    barrier, as fleet's gloo does."""

    def __init__(self, count: int):
        self.count = count
        self.barrier = threading.Barrier(count, timeout=30)
        self.values: list = [None] * count
        self.endpoints = [f"127.0.0.1:{7000 + i}" for i in range(count)]

    def role(self, index: int):
        workers = self

        class Role:
            def worker_index(self):
                return index

            def worker_num(self):
                return workers.count

            def get_trainer_endpoints(self):
                return list(workers.endpoints)

            def all_gather(self, value):
                workers.values[index] = value
                workers.barrier.wait()
                gathered = list(workers.values)
                workers.barrier.wait()
                return gathered

        return Role()


def in_worker_order(arrays: list) -> np.ndarray:
    total = arrays[0].copy()
    for array in arrays[1:]:
        total += array
    return total
