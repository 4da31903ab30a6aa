"""The parameter servers' exchange: one strategy exchange for every workload.

Paddle 2.6.2's own parameter-server strategies cannot be used from ``exe.run``: async
never pulls dense parameters back, sync crashes in ``SendBarrierOp`` and geo sends no
dense parameters.  So kspipe drives the exchange itself over the servers' tables:

* :class:`kspipe.modes.ps.dense.ParameterExchange` moves dense parameters (in
  kspipe/modes/ps/dense.py, with the table's :class:`~kspipe.modes.ps.dense.Layout`).  A
  one-op "meta program",
  ``sum(theta * g)``, is transpiled by fleet with SGD of step 1 on the servers, so pushing
  ``g`` (its ``send`` op alone, run on ``g`` written in as theta's gradient) makes the
  servers do ``theta -= g`` (an add, applied as it arrives); ``write`` sets
  the servers' values and returns once they hold them; ``pull`` reads them.  Theta is one
  flat table: the parameters, and in every part of it that a server
  applies on a thread of its own, a count of each worker's pushes, which each push adds
  1 to.  So a pull tells a worker how many of its own pushes the values hold.
* :class:`StrategyExchange` is the strategies over it.  After each local update:

  - ``async``: the worker pushes the change of its step and pulls the servers'
    parameters once.  Workers never wait for each other.  Paddle's client queues up to
    14 pushes, and on a loaded host a worker that stepped from values missing its last
    dozen pushes overshot by as many steps (a test R2 of 0.59 where 0.95 is usual); so
    the worker keeps each push until every part of every server has begun to apply it,
    and adds it back where a part had not: it goes on from values that hold all its own
    pushes but one at most (``cluster.wait_push=true``: all of them, ``client_flush``,
    >= 100 ms a step).  A change made while the worker's last push is still on its way
    is held and goes with the next push, summed (as Paddle's own async communicator
    merges what its queue holds): about one push every two steps on loopback;
  - ``sync``: a round of all workers.  Their changes are summed in worker order
    (:class:`kspipe.modes.summing.WorkerSum`, from 3 workers on shared with a summer
    beside each server: :mod:`kspipe.modes.ps.sharded`); every worker goes on from
    ``theta - sum / workers``.  The servers get it when they are read (a checkpoint,
    the end): the first worker writes the last round back, and they confirm it.
    Nothing is lost and the same run gives the same parameters, bit for bit;
  - ``geo``: updates stay local; every ``k_steps`` updates, and at every checkpoint, a
    sync round (geo-SGD with rounds that every worker joins: LocalSGD over the servers).

Paddle's brpc client holds dense pushes back for merging (up to 12, or until a
``client_flush``, which polls every 100 ms); kspipe's client flags make it send each push
at once, so an async step costs a push and a pull (~2 ms on loopback), not a flush.

A workload reaches this through its role (``parameter_sync``, ``distributed_optimizer``),
never by importing it.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from kspipe.errors import ClusterError, ConfigError, check_integer
from kspipe.modes.ps import sharded
from kspipe.modes.ps.dense import ParameterExchange
from kspipe.modes.role import ParameterSync, read_vars, write_vars
from kspipe.process import heartbeat

STRATEGIES = ("sync", "async", "geo")


def check_strategy(strategy: str, k_steps=1, what: str = "cluster.strategy") -> None:
    """The one check of a parameter-server strategy (config and OpenKS API alike)."""
    if strategy == "half_async":
        raise ConfigError(
            f"{what}=half_async: Paddle 2.6.2's fleet parameter server has no "
            f"half-async mode (its DistributedStrategy selects only sync, async "
            f"or geo); use async"
        )
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"{what}={strategy!r} is not one of {', '.join(STRATEGIES + ('half_async',))}"
        )
    if strategy == "geo":
        check_integer(k_steps, "cluster.k_steps", 1)


#: A push the servers have not applied after this long is lost (or a server stalled).
PUSH_TIMEOUT_S = 120.0
#: What a worker waits in, in each timed part of the exchange.
PHASES = {
    "pull": "pulling from the servers",
    "push": "pushing to the servers",
    "all-reduce": "in the {} round's sum",
    "write": "writing the last round to the servers",
    "flush": "waiting for the servers to apply its pushes",
    "connect": "connecting to the servers",
}


class StrategyExchange(ParameterSync):
    """A worker's side of the strategy over a :class:`ParameterExchange`."""

    changes_parameters = True

    def __init__(
        self,
        role,
        shapes: dict,
        strategy: str,
        k_steps: int = 1,
        wait_push: bool = False,
        shard_sum: bool = True,
    ):
        check_strategy(strategy, k_steps)
        self.role = role
        self.names = list(shapes)
        self.exchange = ParameterExchange(shapes)
        self.strategy, self.k_steps, self.wait_push = strategy, k_steps, wait_push
        if strategy == "sync":
            self.k_steps = 1
        self.scope = None
        self.summing = None  # sync and geo: the workers' changes summed (WorkerSum)
        self.shard_sum = shard_sum  # sync and geo: with the servers' summers, if it pays
        self.summer = None  # a server's shard summer (its process), if the rounds use it
        if strategy != "async" and shard_sum and role.is_server():
            self.summer = sharded.start_summer(role, len(self.exchange.layout.weights))
        self.steps = 0  # updates since the last exchange
        self.pushed = 0  # async: this worker's pushes so far
        self.unapplied: list = []  # async: [(push number, change)] not begun everywhere
        self.unapplied_since = 0.0  # since when the oldest of them is waited for
        self.view = None  # async: the parameters this worker went on from (flattened)
        self.held = None  # async: changes not pushed yet, to go with the next push
        self.seconds: dict = {}  # time spent in each part of the exchanges so far
        self.unwritten = False  # the first worker: the servers lack the last round

    @contextlib.contextmanager
    def timed(self, part: str):
        """Time ``part``, a wait on the servers or the other workers (a phase of the
        process, for its launcher's watch of stalls: kspipe/process/heartbeat.py)."""
        started = time.perf_counter()
        try:
            with heartbeat.phase(PHASES[part].format(self.strategy), waiting=True):
                yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started

    def connect(self, scope) -> None:
        """Worker 0's parameters become the servers'; every worker takes them."""
        self.scope = scope
        with heartbeat.phase(PHASES["connect"], waiting=True):
            write_vars(scope, self.exchange.connect(read_vars(scope, self.names)))
        if self.strategy != "async":
            size = len(self.exchange.layout.weights)
            self.summing = sharded.worker_sum(self.role, size, self.shard_sum)

    def step(self, scope=None, values: dict | None = None) -> None:
        """After a local update (the parameters in ``scope``, or ``values``): exchange."""
        if self.exchange.runtime is None:
            return
        scope = scope or self.scope
        current = values if values is not None else read_vars(scope, self.names)
        self.steps += 1
        if self.strategy == "async":
            self._push_pull(scope, current)
        elif self.steps >= self.k_steps:
            self._round(scope, current)

    def _push_pull(self, scope, current: dict) -> None:
        """Push this step's change, pull once, and go on from the servers' parameters with
        this worker's pushes that a part's server had not begun to apply added back.

        While a push of this worker is not yet begun everywhere, the next change is held
        and goes with the push after it, summed (as Paddle's own async communicator
        merges what its queue holds): on a busy host a server then applies fewer, larger
        pushes, and the worker goes on from values that hold its held change too."""
        worker, layout = self.role.worker_index(), self.exchange.layout
        if self.view is None:
            self.view = self.exchange.flat()[layout.weights]
        change = self.view - layout.flatten(current)
        if self.held is not None:
            change += self.held
        if self.unapplied and not self.wait_push:
            self.held = change
        else:
            self.held = None
            self._push(change)
        with self.timed("pull"):
            self.view, begun = self.exchange.pull_own(worker, self.unapplied)
            self._forget(begun)
        if self.held is not None:
            self.view -= self.held
        write_vars(scope, layout.unflatten(self.view))
        self.steps = 0

    def _push(self, change) -> None:
        with self.timed("push"):
            change = self.exchange.push(
                change, self.role.worker_index(), self.pushed, wait=self.wait_push
            )
            self.pushed += 1
            if not self.unapplied:
                self.unapplied_since = time.monotonic()
            self.unapplied.append((self.pushed, change))

    def _flush(self) -> None:
        """async: push the held change, and wait until the servers have applied every push
        of this worker; the servers' parameters are then all there is to go on from."""
        held, self.held = self.held, None
        if held is not None:
            self._push(held)
        with heartbeat.phase(PHASES["flush"], waiting=True):
            self.exchange.flush()
        self.unapplied, self.view = [], None

    def _forget(self, begun: int) -> None:
        """Drop the oldest ``begun`` pushes, which every part's server has begun to apply.
        A push still missing somewhere :data:`PUSH_TIMEOUT_S` after it was made, or after
        the one before it was begun everywhere, was lost (or a server stalled)."""
        now = time.monotonic()
        if begun:
            del self.unapplied[:begun]
            self.unapplied_since = now
        elif now - self.unapplied_since > PUSH_TIMEOUT_S:
            raise ClusterError(
                f"worker {self.role.worker_index()}: the servers have not "
                f"applied its push {self.unapplied[0][0]} of {self.pushed} "
                f"within {PUSH_TIMEOUT_S:.0f} s (a push lost, or a server "
                f"stalled)"
            )

    def _round(self, scope, current: dict) -> None:
        """Every worker's change since the last round, summed in a fixed order; theta moves
        by their mean, on the servers (written before anyone goes on) and in every worker."""
        last = self.exchange.get()
        changes = [(last[n] - current[n]).ravel() for n in self.names]
        with self.timed("all-reduce"):
            total = self.summing.sum(np.concatenate(changes).astype(np.float64))
        mean = (total / self.role.worker_num()).astype(np.float32)
        merged, at = {}, 0
        for n in self.names:
            size = last[n].size
            merged[n] = last[n] - mean[at : at + size].reshape(last[n].shape)
            at += size
        if self.role.is_first_worker():
            self._write(merged)
        else:
            self.exchange.hold(merged)
        write_vars(scope, merged)
        self.steps = 0

    def _write(self, merged: dict) -> None:
        """The first worker holds the round, to write to the servers when someone reads
        them: each round's write of the whole model through worker 0's link cost a sync
        round a third more time (and Paddle's client holds the interpreter's lock while
        it writes, so it cannot overlap the next round's sum).  What reads the servers
        (:meth:`finish`, :meth:`settle` before a checkpoint, :meth:`close`) calls
        :meth:`write_back` first, so no round is ever missing from what is read."""
        self.exchange.hold(merged)
        self.unwritten = True

    def write_back(self) -> None:
        """The first worker: write the last round to the servers, if they lack it; return
        once every server holds it."""
        if self.unwritten and self.exchange.runtime is not None:
            with self.timed("write"):
                self.exchange.write_held()
        self.unwritten = False

    def finish(self, scope) -> None:
        """Send what is still local, wait for every worker, take the final parameters."""
        if self.exchange.runtime is None:
            return
        if self.strategy == "async":
            self._flush()
        elif self.strategy == "geo":  # every worker joins the last round, steps or none
            self._round(scope, read_vars(scope, self.names))
        self.write_back()
        self.role.barrier_worker()
        with heartbeat.phase(PHASES["pull"], waiting=True):
            write_vars(scope, self.exchange.pull())

    def refresh(self, scope) -> None:
        """Take the servers' parameters mid-training (async; sync and geo hold the last
        round's already, and geo's steps since then stay local).  No workload of kspipe's
        needs it (their checkpoints :meth:`settle`, with every worker); an OpenKS script's
        first worker does, alone, before it saves
        (:class:`kspipe.openks.GeneralDistributedOptimizer`)."""
        if self.exchange.runtime is not None and self.strategy == "async":
            self._flush()
            write_vars(scope, self.exchange.pull())

    def settle(self) -> None:
        """Before a checkpoint, every worker: the scope then holds the servers' parameters
        exactly, so the state written into the checkpoint is the job's one model.

        * async: every push in (each worker's flushed, then a barrier), then a pull
          (float32: a table the exchange moves is whole in every worker, where the
          servers' own files would keep 6 digits of it);
        * geo: a round, whatever ``k_steps`` says, so no worker's local steps are left out
          of the checkpoint.  The uninterrupted run makes the same round at the same
          checkpoint, so a run resumed from it repeats that run exactly;
        * sync: every round already ended so (the last one written back to the servers).
        """
        if self.exchange.runtime is None:
            return
        if self.strategy == "async":
            self._flush()
            self.role.barrier_worker()
            write_vars(self.scope, self.exchange.pull())
        elif self.strategy == "geo":  # every worker joins, steps since the last or none
            self._round(self.scope, read_vars(self.scope, self.names))
        self.write_back()  # sync and geo: the servers hold the last round

    def close(self, clean: bool = True) -> None:
        if clean:
            self.write_back()
        if clean and self.exchange.runtime is not None:
            self.role.barrier_worker()  # the first worker stops the servers after the rest
        if self.summing is not None:
            self.summing.close()
        self.exchange.close(self.role.is_first_worker())


class ExchangingOptimizer:
    """An optimiser that steps locally, then exchanges through a :class:`StrategyExchange`.

    ``minimize(loss)`` adds the inner optimiser's ops, then a ``py_func`` op at the end of
    the program that hands the updated parameters to the exchange, so every ``exe.run``
    of the program is one step of the strategy.
    """

    def __init__(self, role, optimizer, cfg_cluster: dict):
        self._role, self._inner, self._cluster = role, optimizer, cfg_cluster
        self.sync = None

    def backward(
        self, loss, startup_program=None, parameter_list=None, no_grad_set=None, callbacks=None
    ):
        return self._inner.backward(loss, startup_program, parameter_list, no_grad_set, callbacks)

    def apply_gradients(self, params_grads):
        import paddle

        ops = self._inner.apply_gradients(params_grads)
        params = [p for p, _ in params_grads]
        names = [p.name for p in params]
        self.sync = self._role.parameter_sync(
            {p.name: list(p.shape) for p in params}, **self._cluster
        )

        def after_step(*values):
            self.sync.step(values=dict(zip(names, (np.array(v) for v in values))))

        with params[0].block.program._optimized_guard([]):  # a for_test clone drops it
            paddle.static.py_func(after_step, x=params, out=None)
        return ops

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        params_grads = self.backward(loss, startup_program, parameter_list, no_grad_set)
        return self.apply_gradients(params_grads), params_grads
