"""The OpenKS distributed layer's Python API, over kspipe's own stage implementations.

Scripts written against the seed's classes run unchanged, locally, on a loopback
parameter-server cluster (``kspipe-launch --mode cpu ...``) and collectively
(``--mode gpu``, through gloo on a CPU build)::

    algorithm = KSDistributedFactory.instantiation(flag=0)  # 0: parameter servers, 1: collective
    algorithm.init(PaddleCloudRoleMaker())
    optimizer = algorithm.distributed_optimizer(paddle.optimizer.SGD(0.01), strategy)
    optimizer.minimize(loss)
    if algorithm.is_server():
        algorithm.init_server(); algorithm.run_server()
    else:
        algorithm.init_worker(); ...exe.run(...)...; algorithm.stop_worker()

Roles are :class:`kspipe.builtin.pserver.FleetRole` and
:class:`kspipe.builtin.collective.CollectiveRole`, and parameters travel through
:class:`kspipe.builtin.pserver.ParameterExchange`, as in ``kspipe mode=pserver``.
Differences from the seed, where its behaviour was broken: ``split_files`` gives whole
files in contiguous blocks (the seed divided with ``/`` and sliced with floats); a
script's optimiser runs on the worker and what is exchanged is the change it made to the
parameters (see :class:`GeneralDistributedOptimizer`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from kspipe.errors import ConfigError
from kspipe.role import Role

__all__ = [
    "RoleMakerBase", "PaddleCloudRoleMaker", "KSDistributedFactory", "BaseDistributedAlgorithm",
    "CPUDistributedAlgorithm", "GPUDistributedAlgorithm", "BaseDistributedOptimizer",
    "GeneralDistributedOptimizer", "HeterogeneousDistributedOptimizer", "SyncStrategy",
    "AsyncStrategy", "HalfAsyncStrategy", "GeoStrategy", "CollectiveStrategy",
    "Open_KS_ImageNet", "Open_KS_Character", "Open_KS_read",
]

from kspipe.data import Open_KS_Character, Open_KS_ImageNet, Open_KS_read  # noqa: E402


# --- strategies ---------------------------------------------------------------------


@dataclass
class SyncStrategy:
    """Workers wait for each other every step; the servers apply the mean change."""

    mode = "sync"


@dataclass
class AsyncStrategy:
    """Each worker's change is applied as soon as it arrives."""

    mode = "async"


@dataclass
class HalfAsyncStrategy:
    """The seed's half-async mode: refused, Paddle 2.6.2's fleet has none."""

    mode = "half_async"


@dataclass
class GeoStrategy:
    """Local steps; every ``k_steps`` the change (divided among workers) is exchanged."""

    k_steps: int = 1
    mode = "geo"


@dataclass
class CollectiveStrategy:
    """Collective training: ``gradient_allreduce`` every step, or ``local_sgd`` every
    ``k_steps`` steps (parameters averaged); ``thread_num`` math threads per worker."""

    mode: str = "gradient_allreduce"
    k_steps: int = 1
    thread_num: int | None = None


# --- roles --------------------------------------------------------------------------


class RoleMakerBase(Role):
    """The seed's base role maker: a one-process job, as :class:`kspipe.role.Role`."""


class PaddleCloudRoleMaker(RoleMakerBase):
    """The role read from the environment the launcher (or a scheduler) set."""

    def __init__(self, is_collective: bool = False):
        self.is_collective = is_collective
        self._role: Role | None = None

    def generate_role(self) -> None:
        if self._role is not None:
            return
        if not self.is_collective and os.environ.get("TRAINING_ROLE"):
            from kspipe.builtin.pserver import FleetRole

            self._role = FleetRole()
        elif self.is_collective and os.environ.get("PADDLE_TRAINER_ENDPOINTS"):
            from kspipe.builtin.collective import CollectiveRole

            self._role = CollectiveRole(_selected_gpus())
        else:
            self._role = Role()

    @property
    def role(self) -> Role:
        self.generate_role()
        return self._role

    def __getattribute__(self, name):
        if name in _ROLE_METHODS:
            return getattr(object.__getattribute__(self, "role"), name)
        return object.__getattribute__(self, name)


_ROLE_METHODS = {n for n in dir(Role) if not n.startswith("_")} - {"is_launcher"}


def _selected_gpus() -> list[int]:
    import paddle

    if not paddle.is_compiled_with_cuda():
        return []
    selected = os.environ.get("FLAGS_selected_gpus")
    return [int(g) for g in selected.split(",")] if selected else list(
        range(paddle.device.cuda.device_count()))


# --- algorithms ---------------------------------------------------------------------


class KSDistributedFactory:
    @staticmethod
    def instantiation(flag: int) -> "BaseDistributedAlgorithm":
        """0: the parameter-server CPU path; 1: the collective (GPU, or CPU through gloo) path."""
        if flag == 0:
            return CPUDistributedAlgorithm()
        if flag == 1:
            return GPUDistributedAlgorithm()
        raise ValueError(f"KSDistributedFactory.instantiation: flag must be 0 or 1, not {flag!r}")


class BaseDistributedAlgorithm:
    """What every distributed algorithm offers: its role and the workers' collectives."""

    collective = False

    def __init__(self, mode=None):
        self.mode = mode
        self._role_maker: PaddleCloudRoleMaker | None = None
        self._optimizer = None

    def init(self, role_maker: RoleMakerBase | None = None) -> None:
        role_maker = role_maker or PaddleCloudRoleMaker(is_collective=self.collective)
        if isinstance(role_maker, PaddleCloudRoleMaker):
            role_maker.is_collective = self.collective
            role_maker.generate_role()
        self._role_maker = role_maker

    @property
    def role(self):
        if self._role_maker is None:
            self.init()
        return self._role_maker

    def is_first_worker(self) -> bool:
        return self.role.is_first_worker()

    def _is_worker(self) -> bool:
        return self.role.is_worker()

    def is_worker(self) -> bool:
        return self.role.is_worker()

    def is_server(self) -> bool:
        return self.role.is_server()

    def worker_num(self) -> int:
        return self.role.worker_num()

    def worker_index(self) -> int:
        return self.role.worker_index()

    def worker_endpoints(self, to_string: bool = False):
        endpoints = self.role.get_trainer_endpoints()
        return ",".join(endpoints) if to_string else endpoints

    def split_files(self, files: list) -> list:
        return self.role.split_files(files)

    def all_reduce_worker(self, input, output) -> None:
        self.role.all_reduce_worker(input, output, "sum")

    def barrier_workers(self) -> None:
        self.role.barrier_worker()

    def init_worker(self) -> None:
        if self._optimizer is not None:
            self._optimizer._start()

    def stop_worker(self) -> None:
        if self._optimizer is not None:
            self._optimizer._stop()

    def save_inference_model(self, executor, dirname, feeded_var_names, target_vars,
                             main_program=None, export_for_deployment=True):
        import paddle

        if self._optimizer is not None:
            self._optimizer._pull()
        program = main_program or paddle.static.default_main_program()
        feeds = [program.global_block().var(n) if isinstance(n, str) else n
                 for n in ([feeded_var_names] if isinstance(feeded_var_names, str) else feeded_var_names)]
        targets = target_vars if isinstance(target_vars, (list, tuple)) else [target_vars]
        os.makedirs(dirname, exist_ok=True)
        paddle.static.save_inference_model(os.path.join(dirname, "model"), feeds, list(targets),
                                           executor, program=program)

    def save_persistables(self, executor, dirname, main_program=None):
        import paddle

        if self._optimizer is not None:
            self._optimizer._pull()
        os.makedirs(dirname, exist_ok=True)
        paddle.static.save(main_program or paddle.static.default_main_program(),
                           os.path.join(dirname, "persistables"))


class CPUDistributedAlgorithm(BaseDistributedAlgorithm):
    """Parameter servers (the seed's transpiler path), on fleet's the_one_ps."""

    def distributed_optimizer(self, optimizer, strategy=None) -> "GeneralDistributedOptimizer":
        self._optimizer = GeneralDistributedOptimizer(optimizer, strategy or AsyncStrategy(),
                                                      algorithm=self)
        return self._optimizer

    def init_server(self, model_dir: str | None = None) -> None:
        import paddle.distributed.fleet as fleet

        self._require_optimizer()
        fleet.init_server(model_dir) if model_dir else fleet.init_server()

    def run_server(self) -> None:
        import paddle.distributed.fleet as fleet

        fleet.run_server()

    def _require_optimizer(self):
        if self._optimizer is None or self._optimizer.exchange is None:
            raise RuntimeError("call distributed_optimizer(...).minimize(loss) first, "
                               "in a process the launcher started as a server")


class GPUDistributedAlgorithm(BaseDistributedAlgorithm):
    """Collective data parallelism (the seed's NCCL2 path); through gloo on a CPU build."""

    collective = True

    def distributed_optimizer(self, optimizer, strategy=None) -> "HeterogeneousDistributedOptimizer":
        self._optimizer = HeterogeneousDistributedOptimizer(
            optimizer, strategy or CollectiveStrategy(), algorithm=self)
        return self._optimizer


# --- optimisers ---------------------------------------------------------------------


class BaseDistributedOptimizer:
    """Wraps a Paddle optimiser; ``minimize`` = ``backward`` + ``apply_gradients``."""

    def __init__(self, optimizer, strategy=None, algorithm=None):
        self._inner = optimizer
        self._strategy = strategy
        self._algorithm = algorithm
        self._program = None

    def backward(self, loss, startup_program=None, parameter_list=None, no_grad_set=None,
                 callbacks=None):
        self._program = loss.block.program
        return self._inner.backward(loss, startup_program, parameter_list, no_grad_set, callbacks)

    def apply_gradients(self, params_grads):
        return self._inner.apply_gradients(params_grads)

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        params_grads = self.backward(loss, startup_program, parameter_list, no_grad_set)
        optimize_ops = self.apply_gradients(params_grads)
        return optimize_ops, params_grads

    def _start(self):
        pass

    def _stop(self):
        pass

    def _pull(self):
        pass


class GeneralDistributedOptimizer(BaseDistributedOptimizer):
    """Parameter-server training of a script's program.

    The script's optimiser steps locally; a ``py_func`` op at the end of the program then
    sends the change it made to the servers (scaled by 1/workers for sync and geo), waits
    until sent, and takes the servers' parameters back (``sync``: after all workers sent;
    ``geo``: every ``k_steps`` steps).  Paddle 2.6.2's own program rewriting cannot be used
    from ``exe.run``: async never pulls, sync crashes in ``SendBarrierOp``, geo sends no
    dense parameters (docs/distributed.md).
    """

    def __init__(self, optimizer, strategy=None, algorithm=None):
        mode = getattr(strategy, "mode", "async")
        if mode == "half_async":
            raise ConfigError("HalfAsyncStrategy: Paddle 2.6.2's fleet parameter server has no "
                              "half-async mode; use AsyncStrategy or SyncStrategy")
        if mode not in ("sync", "async", "geo"):
            raise ConfigError(f"a parameter-server strategy must be sync, async or geo, not {mode!r}")
        super().__init__(optimizer, strategy, algorithm)
        self.exchange = None
        self.params: list[str] = []
        self.steps = 0
        self.mode = mode

    def apply_gradients(self, params_grads):
        import paddle

        from kspipe.builtin.pserver import ParameterExchange

        ops = self._inner.apply_gradients(params_grads)
        if not hasattr(self._algorithm.role.role, "fleet"):
            return ops  # one process: nothing to exchange
        params = [p for p, _ in params_grads]
        self.params = [p.name for p in params]
        self.exchange = ParameterExchange({p.name: list(p.shape) for p in params})
        paddle.static.py_func(lambda *values: self._after_step(values), x=params, out=None)
        return ops

    def _start(self):
        import paddle

        if self.exchange is None:
            return
        scope = paddle.static.global_scope()
        values = {n: np.array(scope.find_var(n).get_tensor()) for n in self.params}
        self._set(self.exchange.connect(values))

    def _after_step(self, values):
        if self.exchange is None or self.exchange.runtime is None:
            return
        workers = self._algorithm.worker_num()
        current = dict(zip(self.params, (np.array(v) for v in values)))
        self.steps += 1
        if self.mode == "geo" and self.steps % self._strategy.k_steps:
            return
        last = self.exchange.get()
        scale = 1.0 if self.mode == "async" else 1.0 / workers
        self.exchange.push({n: scale * (last[n] - current[n]) for n in self.params})
        if self.mode == "sync":
            self._algorithm.barrier_workers()
        self._set(self.exchange.pull())

    def _pull(self):
        if self.exchange is not None and self.exchange.runtime is not None:
            self.exchange.flush()
            self._set(self.exchange.pull())

    def _stop(self):
        if self.exchange is None or self.exchange.runtime is None:
            return
        self.exchange.flush()
        self._algorithm.barrier_workers()
        self.exchange.close(self._algorithm.is_first_worker())

    @staticmethod
    def _set(values: dict):
        import paddle

        scope = paddle.static.global_scope()
        for name, value in values.items():
            scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())


class HeterogeneousDistributedOptimizer(BaseDistributedOptimizer):
    """Collective training of a script's program: the gradients are all-reduced (mean)
    across workers before the optimiser applies them, or with ``local_sgd`` the
    parameters are averaged every ``k_steps`` steps."""

    def apply_gradients(self, params_grads):
        import paddle

        role = self._algorithm.role
        if self._strategy.thread_num:
            os.environ["OMP_NUM_THREADS"] = str(self._strategy.thread_num)
        if self._strategy.mode == "local_sgd":
            ops = self._inner.apply_gradients(params_grads)
            self._steps = 0
            paddle.static.py_func(lambda *values: self._average(values),
                                  x=[p for p, _ in params_grads], out=None)
            self._params = [p.name for p, _ in params_grads]
            return ops
        if self._strategy.mode != "gradient_allreduce":
            raise ConfigError(f"CollectiveStrategy.mode must be gradient_allreduce or local_sgd, "
                              f"not {self._strategy.mode!r}")
        names = [g.name for _, g in params_grads]
        for _, grad in params_grads:
            grad.persistable = True  # kept in the scope, where the all-reduce rewrites it

        def mean_over_workers(*_):
            scope = paddle.static.global_scope()
            for name in names:
                tensor = scope.find_var(name).get_tensor()
                tensor.set(_all_reduce_mean(role, np.array(tensor)), paddle.CPUPlace())

        # runs after the backward ops and before the optimiser's, which read the mean
        paddle.static.py_func(mean_over_workers, x=[g for _, g in params_grads], out=None)
        return self._inner.apply_gradients(params_grads)

    def _average(self, values):
        import paddle

        self._steps += 1
        if self._steps % self._strategy.k_steps:
            return
        scope = paddle.static.global_scope()
        role = self._algorithm.role
        for name, value in zip(self._params, values):
            scope.find_var(name).get_tensor().set(_all_reduce_mean(role, np.array(value)),
                                                  paddle.CPUPlace())

    def _stop(self):
        self._algorithm.barrier_workers()


def _all_reduce_mean(role, value: np.ndarray) -> np.ndarray:
    if role.worker_num() == 1:
        return value
    total = np.empty_like(value)
    role.all_reduce_worker(value, total, "sum")
    return (total / role.worker_num()).astype(value.dtype)
