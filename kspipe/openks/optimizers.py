"""The OpenKS optimisers and strategies, over the modes' distribution.

A script's optimiser is wrapped by its role's ``distributed_optimizer``: parameter servers
(:class:`GeneralDistributedOptimizer`: the optimiser steps on the worker, then the
strategy's exchange, :mod:`kspipe.modes.ps.exchange`) or collective
(:class:`HeterogeneousDistributedOptimizer`: gradients all-reduced in the program, or
with ``local_sgd`` the parameters averaged every ``k_steps`` steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kspipe.errors import ConfigError
from kspipe.modes.ps.exchange import check_strategy

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
    ``k_steps`` steps (parameters averaged); ``thread_num`` math threads per worker;
    ``build_strategy`` options for the compiled program."""

    mode: str = "gradient_allreduce"
    k_steps: int = 1
    thread_num: int | None = None
    build_strategy: dict | None = None  # BuildStrategy options for ``_try_to_compile``


# --- optimisers ---------------------------------------------------------------------


class BaseDistributedOptimizer:
    """Wraps a Paddle optimiser; ``minimize`` = ``backward`` + ``apply_gradients``."""

    def __init__(self, optimizer, strategy=None, algorithm=None):
        self._inner = optimizer
        self._strategy = strategy
        self._algorithm = algorithm
        self._distributed = None  # the role's wrapper of ``optimizer``

    def backward(
        self, loss, startup_program=None, parameter_list=None, no_grad_set=None, callbacks=None
    ):
        return self._inner.backward(loss, startup_program, parameter_list, no_grad_set, callbacks)

    def apply_gradients(self, params_grads):
        return (self._distributed or self._inner).apply_gradients(params_grads)

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        params_grads = self.backward(loss, startup_program, parameter_list, no_grad_set)
        optimize_ops = self.apply_gradients(params_grads)
        return optimize_ops, params_grads

    def refresh_parameters(self, scope) -> None:
        """Take the job's current parameters into ``scope`` mid-training (before a save).
        Here (collective, or one process): nothing to take, the worker's scope holds them."""

    def settle_parameters(self) -> None:
        """Every worker at once: each worker's scope then holds the job's one model.
        Here (collective, or one process): they do already."""


class GeneralDistributedOptimizer(BaseDistributedOptimizer):
    """Parameter-server training of a script's program (sync, async or geo).

    ``program``: the script's program it trains, once ``minimize`` ran (its persistables
    are what ``init_server(model_dir)`` starts the job from).
    """

    def __init__(self, optimizer, strategy=None, algorithm=None):
        mode = getattr(strategy, "mode", "async")
        check_strategy(mode, getattr(strategy, "k_steps", 1), what="the strategy")
        super().__init__(optimizer, strategy, algorithm)
        self.mode = mode
        self.program = None

    def apply_gradients(self, params_grads):
        self.program = params_grads[0][0].block.program
        role = self._algorithm._mode_role()
        self._distributed = role.distributed_optimizer(
            self._inner, {"strategy": self.mode, "k_steps": getattr(self._strategy, "k_steps", 1)}
        )
        return self._distributed.apply_gradients(params_grads)

    def refresh_parameters(self, scope) -> None:
        """Take the servers' parameters into ``scope`` (async: a worker's own hold only its
        pushes; sync and geo: the last round's already)."""
        exchange = getattr(self._distributed, "sync", None)  # none in a one-process job
        if exchange is not None:
            exchange.refresh(scope)

    def settle_parameters(self) -> None:
        """Every worker at once: async, each worker's pushes in and the servers'
        parameters pulled; geo, a round of everyone's local steps; sync, nothing left."""
        exchange = getattr(self._distributed, "sync", None)
        if exchange is not None:
            exchange.settle()


class HeterogeneousDistributedOptimizer(BaseDistributedOptimizer):
    """Collective training of a script's program (the seed's NCCL2 path).

    ``gradient_allreduce``: ``_transpile`` writes Paddle's collective ops into the program,
    each gradient all-reduced and scaled by 1/workers before the optimiser reads it (gloo on
    CPU, NCCL on GPU; the ring is set up at ``init_worker``); ``_try_to_compile`` then
    compiles it with the strategy's BuildStrategy options.  ``local_sgd``: the optimiser
    steps locally and every ``k_steps`` steps the parameters are averaged.
    """

    def __init__(self, optimizer, strategy=None, algorithm=None):
        super().__init__(optimizer, strategy or CollectiveStrategy(), algorithm)
        self.compiled_program = None
        self._params_grads = []
        self._averaging = None  # local_sgd: the parameters' average over the workers

    def apply_gradients(self, params_grads):
        import os

        strategy = self._strategy
        if strategy.thread_num:
            os.environ["OMP_NUM_THREADS"] = str(strategy.thread_num)
        if strategy.mode == "gradient_allreduce":
            self._params_grads = params_grads
            self._transpile(None, params_grads[0][1].block.program)
            return self._distributed.apply_gradients(params_grads)
        if strategy.mode != "local_sgd":
            raise ConfigError(
                f"CollectiveStrategy.mode must be gradient_allreduce or local_sgd, "
                f"not {strategy.mode!r}"
            )
        return self._local_sgd(params_grads)

    def settle_parameters(self) -> None:
        """local_sgd: the workers' local steps since the last average are averaged now."""
        if self._averaging is not None:
            self._averaging.step()

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        import paddle

        result = super().minimize(loss, startup_program, parameter_list, no_grad_set)
        self._try_to_compile(
            startup_program or paddle.static.default_startup_program(), loss.block.program
        )
        return result

    def _transpile(self, startup_program, main_program):
        """Make ``main_program`` collective: the role's distributed optimiser writes the
        all-reduce of each gradient into it (as the seed's NCCL2 transpiler did)."""
        if self._distributed is None:
            self._distributed = self._algorithm._mode_role().distributed_optimizer(self._inner)

    def _try_to_compile(self, startup_program, main_program):
        """``main_program`` (transpiled) compiled with ``strategy.build_strategy`` options,
        kept as ``compiled_program`` for the script to run."""
        import paddle

        self._transpile(startup_program, main_program)
        build = paddle.static.BuildStrategy()
        for name, value in (getattr(self._strategy, "build_strategy", None) or {}).items():
            if not hasattr(build, name):
                raise ConfigError(
                    f"CollectiveStrategy.build_strategy: Paddle's BuildStrategy "
                    f"has no option {name!r}"
                )
            setattr(build, name, value)
        self.compiled_program = paddle.static.CompiledProgram(main_program, build_strategy=build)

    def _local_sgd(self, params_grads):
        import paddle

        role, strategy = self._algorithm._mode_role(), self._strategy
        ops = self._inner.apply_gradients(params_grads)
        sync = role.parameter_sync({p.name: list(p.shape) for p, _ in params_grads})
        self._averaging = sync
        names = [p.name for p, _ in params_grads]
        steps = [0]

        def average(*values):
            steps[0] += 1
            if steps[0] % strategy.k_steps == 0:
                sync.step(values=dict(zip(names, (np.array(v) for v in values))))

        with params_grads[0][0].block.program._optimized_guard([]):
            paddle.static.py_func(average, x=[p for p, _ in params_grads], out=None)
        return ops
