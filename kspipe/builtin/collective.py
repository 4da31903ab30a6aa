"""Mode ``collective``: data-parallel Reptile, the workers' meta-updates all-reduced.

Stages ``role``, ``compile`` and ``execute``.  Started without ``PADDLE_TRAINER_ID`` in the
environment, the role stage is a launcher that starts ``workers`` processes (one per GPU
of ``devices`` on a GPU build) with Paddle's collective environment contract
(``PADDLE_TRAINER_ID``, ``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_CURRENT_ENDPOINT``).

Each meta-iteration every worker adapts theta on its own meta-batch of tasks, then the
workers all-reduce (sum) their updates ``theta - mean(phi)`` and all apply the mean:
``theta <- theta - eps * mean_w(theta - mean(phi_w))``, Reptile with a meta-batch spread
over the workers (the OpenKS GPU path's LocalSGD, with the inner loop as the local
steps).  The update is one vector of the model's size per meta-iteration, reduced through
gloo on the host; the inner loops run on each worker's place (CPU, or its GPU).
"""

from __future__ import annotations

import os

import numpy as np

from kspipe import hookimpl
from kspipe.builtin.local import compile_programs
from kspipe.cluster import check_port_free, gloo_env, local_endpoints, run_cluster, this_host, \
    threads_per_worker
from kspipe.errors import ConfigError
from kspipe.learner import ReptileLearner, train_on_workers
from kspipe.role import FleetCollectives, Role


@hookimpl
def kspipe_assign_role(cfg):
    devices = gpu_devices(cfg)
    if os.environ.get("PADDLE_TRAINER_ID") is not None and os.environ.get("PADDLE_TRAINER_ENDPOINTS"):
        return CollectiveRole(devices)
    return CollectiveLauncher(cfg, devices)


def gpu_devices(cfg) -> list[int]:
    """The GPUs to run on: ``devices`` (a list or "0,1"), all visible ones, or none (CPU)."""
    import paddle

    wanted = cfg.get("devices")
    compiled = paddle.is_compiled_with_cuda()
    if wanted is None:
        return list(range(paddle.device.cuda.device_count())) if compiled else []
    if isinstance(wanted, int):
        ids = [wanted]
    elif isinstance(wanted, str):
        ids = [int(d) for d in wanted.replace(" ", "").split(",") if d]
    else:
        ids = [int(d) for d in wanted]
    if not compiled:
        raise ConfigError(f"devices={wanted}: this Paddle is a CPU build, so NCCL is not "
                          f"available; install paddlepaddle-gpu==2.6.2, or leave devices unset "
                          f"to run the collective mode on CPU through gloo")
    count = paddle.device.cuda.device_count()
    missing = [d for d in ids if d < 0 or d >= count]
    if missing:
        raise ConfigError(f"devices={wanted}: no GPU {', '.join(map(str, missing))} here "
                          f"({count} visible)")
    return ids


class CollectiveRole(FleetCollectives, Role):
    """One worker of a collective job, read from Paddle's environment variables."""

    def __init__(self, devices: list[int]):
        import paddle
        import paddle.distributed.fleet as fleet

        paddle.enable_static()
        self.fleet = fleet
        self.devices = devices
        fleet.init(fleet.PaddleCloudRoleMaker(is_collective=True), is_collective=True)

    def worker_num(self):
        return self.fleet.worker_num()

    def worker_index(self):
        return self.fleet.worker_index()

    def get_trainer_endpoints(self):
        return list(self.fleet.worker_endpoints())

    def place(self):
        import paddle

        if not self.devices:
            return paddle.CPUPlace()
        return paddle.CUDAPlace(self.devices[self.worker_index() % len(self.devices)])


class CollectiveLauncher(Role):
    """Starts this host's workers of a collective job and watches them."""

    is_launcher = True

    def __init__(self, cfg, devices: list[int]):
        self.cfg = cfg
        if devices and isinstance(cfg.workers, int) and cfg.workers != len(devices):
            raise ConfigError(f"workers={cfg.workers} but devices names {len(devices)} GPU(s): "
                              f"a collective job runs one worker per GPU")
        self.devices = devices
        self.workers = local_endpoints(len(devices) if devices else cfg.workers, "workers")
        self.host = this_host(cfg, self.workers)

    def worker_num(self):
        return len(self.workers)

    def launch(self, reporter) -> dict:
        cfg = self.cfg
        local = [(i, e) for i, e in enumerate(self.workers) if e.rpartition(":")[0] == self.host]
        if not local:
            raise ConfigError(f"no worker endpoint is on cluster.host={self.host}")
        for _, endpoint in local:
            host, _, port = endpoint.rpartition(":")
            check_port_free(host, int(port))
        first_host, _, first_port = self.workers[0].rpartition(":")
        base = dict(os.environ, PADDLE_TRAINER_ENDPOINTS=",".join(self.workers),
                    PADDLE_TRAINERS_NUM=str(len(self.workers)), GLOG_minloglevel="2",
                    **gloo_env(reporter.run_dir, self.workers, f"{first_host}:{first_port}"))
        threads = threads_per_worker(cfg, len(local))
        plan = [("worker", i, dict(base, PADDLE_TRAINER_ID=str(i), PADDLE_CURRENT_ENDPOINT=e,
                                   OMP_NUM_THREADS=str(threads)))
                for i, e in local]
        where = f"GPUs {self.devices}" if self.devices else "CPU, gloo"
        return run_cluster(cfg, reporter, plan, f"{len(self.workers)} collective worker(s) ({where})")


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    if getattr(role, "devices", None):  # oneDNN kernels are for the CPU
        cfg = cfg.copy()
        cfg.compile.onednn_conv = False
    return compile_programs(cfg, programs)


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    learner = ReptileLearner(cfg, dataset, programs, executor, scope, reporter, role)
    workers = role.worker_num()

    def all_reduce_update(eps: float, count: int) -> None:
        names = programs.params
        theta = learner.values([n + "@THETA" for n in names])
        acc = learner.values([n + "@ACC" for n in names])
        local = np.concatenate([(t - a / count).ravel() for t, a in zip(theta, acc)])
        total = np.empty_like(local)
        role.all_reduce_worker(local, total, "sum")
        offset = 0
        for name, t in zip(names, theta):
            new = t - eps * total[offset:offset + t.size].reshape(t.shape) / workers
            offset += t.size
            for var in (name, name + "@THETA"):
                scope.find_var(var).get_tensor().set(new.astype(np.float32), executor.place)
            scope.find_var(name + "@ACC").get_tensor().set(np.zeros_like(t), executor.place)

    return train_on_workers(learner, all_reduce_update)
