"""Roles: which part of a job this process plays (the seed's RoleMaker API)."""

from __future__ import annotations

import numpy as np


class Role:
    """A process's place in a job.  This base class is a one-process job: the only worker.

    The method names follow the seed's ``RoleMakerBase``; distributed modes subclass it.
    """

    is_launcher = False

    def is_worker(self) -> bool:
        return True

    def is_server(self) -> bool:
        return False

    def is_first_worker(self) -> bool:
        return self.is_worker() and self.worker_index() == 0

    def worker_num(self) -> int:
        return 1

    def worker_index(self) -> int:
        return 0

    def server_index(self) -> int:
        return -1

    def get_trainer_endpoints(self) -> list[str]:
        return []

    def get_pserver_endpoints(self) -> list[str]:
        return []

    def to_string(self) -> str:
        kind = "server" if self.is_server() else "worker"
        index = self.server_index() if self.is_server() else self.worker_index()
        return (f"role={kind} index={index} worker_num={self.worker_num()} "
                f"trainer_endpoints={self.get_trainer_endpoints()} "
                f"pserver_endpoints={self.get_pserver_endpoints()}")

    def place(self):
        """The Paddle place this role computes on."""
        import paddle

        return paddle.CPUPlace()

    # Collective helpers.  A one-process job gathers and reduces over itself.

    def all_gather(self, value) -> list:
        return [value]

    def all_reduce_worker(self, input, output, mode: str = "sum") -> None:
        if mode not in ("sum", "min", "max"):
            raise ValueError(f"all_reduce_worker mode must be sum, min or max, not {mode!r}")
        np.copyto(np.asarray(output), np.asarray(input))

    def barrier_worker(self) -> None:
        pass

    def barrier_all(self) -> None:
        pass

    def split_files(self, files: list) -> list:
        """This worker's share of ``files``: contiguous blocks, the first ones one longer."""
        files = list(files)
        n, i = self.worker_num(), self.worker_index()
        size, extra = divmod(len(files), n)
        start = i * size + min(i, extra)
        return files[start:start + size + (1 if i < extra else 0)]


class FleetCollectives:
    """The workers' collectives through fleet's gloo, for roles that hold ``self.fleet``."""

    def all_gather(self, value) -> list:
        return list(self.fleet.util.all_gather(value, comm_world="worker"))

    def all_reduce_worker(self, input, output, mode: str = "sum") -> None:
        if mode not in ("sum", "min", "max"):
            raise ValueError(f"all_reduce_worker mode must be sum, min or max, not {mode!r}")
        result = self.fleet.util.all_reduce(np.asarray(input), mode=mode, comm_world="worker")
        np.copyto(np.asarray(output), np.asarray(result).reshape(np.shape(output)))

    def barrier_worker(self) -> None:
        self.fleet.util.barrier("worker")

    def barrier_all(self) -> None:
        self.fleet.util.barrier("worker")  # servers sit in run_server: workers are "all"
