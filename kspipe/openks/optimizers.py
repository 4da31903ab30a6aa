"""The OpenKS optimisers and strategies, over the modes' distribution.

A script's optimiser is wrapped by its role's ``distributed_optimizer``: parameter servers
(:class:`GeneralDistributedOptimizer`: the optimiser steps on the worker, then the
strategy's exchange, :mod:`kspipe.modes.exchange`) or collective
(:class:`HeterogeneousDistributedOptimizer`: gradients all-reduced in the program, or
with ``local_sgd`` the parameters averaged every ``k_steps`` steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kspipe.errors import ConfigError
from kspipe.modes.exchange import check_strategy

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


# --- optimisers ---------------------------------------------------------------------


class BaseDistributedOptimizer:
    """Wraps a Paddle optimiser; ``minimize`` = ``backward`` + ``apply_gradients``."""

    def __init__(self, optimizer, strategy=None, algorithm=None):
        self._inner = optimizer
        self._strategy = strategy
        self._algorithm = algorithm
        self._distributed = None  # the role's wrapper of ``optimizer``

    def backward(self, loss, startup_program=None, parameter_list=None, no_grad_set=None,
                 callbacks=None):
        return self._inner.backward(loss, startup_program, parameter_list, no_grad_set,
                                    callbacks)

    def apply_gradients(self, params_grads):
        return (self._distributed or self._inner).apply_gradients(params_grads)

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        params_grads = self.backward(loss, startup_program, parameter_list, no_grad_set)
        optimize_ops = self.apply_gradients(params_grads)
        return optimize_ops, params_grads


class GeneralDistributedOptimizer(BaseDistributedOptimizer):
    """Parameter-server training of a script's program (sync, async or geo)."""

    def __init__(self, optimizer, strategy=None, algorithm=None):
        mode = getattr(strategy, "mode", "async")
        check_strategy(mode, getattr(strategy, "k_steps", 1), what="the strategy")
        super().__init__(optimizer, strategy, algorithm)
        self.mode = mode

    def apply_gradients(self, params_grads):
        role = self._algorithm._mode_role()
        self._distributed = role.distributed_optimizer(
            self._inner, {"strategy": self.mode, "k_steps": getattr(self._strategy, "k_steps", 1)})
        return self._distributed.apply_gradients(params_grads)


class HeterogeneousDistributedOptimizer(BaseDistributedOptimizer):
    """Collective training of a script's program: the gradients are all-reduced (mean)
    across workers in the program before the optimiser applies them, or with
    ``local_sgd`` the parameters are averaged every ``k_steps`` steps."""

    def apply_gradients(self, params_grads):
        import os

        role = self._algorithm._mode_role()
        strategy = self._strategy
        if strategy.thread_num:
            os.environ["OMP_NUM_THREADS"] = str(strategy.thread_num)
        if strategy.mode == "gradient_allreduce":
            self._distributed = role.distributed_optimizer(self._inner)
            return self._distributed.apply_gradients(params_grads)
        if strategy.mode != "local_sgd":
            raise ConfigError(f"CollectiveStrategy.mode must be gradient_allreduce or local_sgd, "
                              f"not {strategy.mode!r}")
        import paddle

        ops = self._inner.apply_gradients(params_grads)
        sync = role.parameter_sync({p.name: list(p.shape) for p, _ in params_grads})
        names = [p.name for p, _ in params_grads]
        steps = [0]

        def average(*values):
            steps[0] += 1
            if steps[0] % strategy.k_steps == 0:
                sync.step(values=dict(zip(names, (np.array(v) for v in values))))

        with params_grads[0][0].block.program._optimized_guard([]):
            paddle.static.py_func(average, x=[p for p, _ in params_grads], out=None)
        return ops

    def _try_to_compile(self, startup_program, main_program):
        """The seed's hook to compile the worker's program: here, ``main_program`` as it is
        (the all-reduce ops are already in it; BuildStrategy options go through the
        ``compile`` stage)."""
        return main_program

    def _transpile(self, startup_program, main_program):
        """The seed's hook to transpile for NCCL2: the collective ops are written by
        ``apply_gradients``, and the ring is set up at ``init_worker``; nothing is left."""
        return main_program
