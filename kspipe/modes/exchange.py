"""The parameter servers' exchange: one strategy exchange for every workload.

Paddle 2.6.2's own parameter-server strategies cannot be used from ``exe.run``: async
never pulls dense parameters back, sync crashes in ``SendBarrierOp`` and geo sends no
dense parameters.  So kspipe drives the exchange itself over the servers' tables:

* :class:`ParameterExchange` moves dense parameters.  A one-op "meta program",
  ``sum(theta * g)``, is transpiled by fleet with SGD of step 1 on the servers, so pushing
  ``g`` (its ``send`` op alone, run on ``g`` written in as theta's gradient) makes the
  servers do ``theta -= g`` (an add, applied as it arrives); ``write`` sets
  the servers' values and returns once they hold them; ``pull`` reads them.  Theta is one
  flat table (:class:`Layout`): the parameters, and in every part of it that a server
  applies on a thread of its own, a count of each worker's pushes, which each push adds
  1 to.  So a pull tells a worker how many of its own pushes the values hold.
* :class:`StrategyExchange` is the strategies over it.  After each local update:

  - ``async``: the worker pushes the change it made since it last took the servers'
    parameters and pulls them back.  Workers never wait for each other; a worker's pull
    holds all its own pushes but at most the last two, and it pulls again until it does
    (``cluster.wait_push=true``: all of them, ``client_flush``, >= 100 ms a step).
    Paddle's client queues up to 14 pushes, and on a loaded host a worker that stepped
    from values missing its last dozen pushes overshot by as many steps (a test R2 of
    0.59 where 0.95 is usual);
  - ``sync``: a round of all workers.  Their changes are summed in worker order
    (:class:`kspipe.modes.summing.WorkerSum`); every worker goes on from
    ``theta - sum / workers``, and the first worker writes it to the servers, which
    confirm it, before the next round.
    Nothing is lost and the same run gives the same parameters, bit for bit;
  - ``geo``: updates stay local; every ``k_steps`` updates, and at every checkpoint, a
    sync round (geo-SGD with rounds that every worker joins: LocalSGD over the servers).

Paddle's brpc client holds dense pushes back for merging (up to 12, or until a
``client_flush``, which polls every 100 ms); :data:`CLIENT_FLAGS` makes it send each push
at once, so an async step costs a push and a pull (~2 ms on loopback), not a flush.

A workload reaches this through its role (``parameter_sync``, ``distributed_optimizer``),
never by importing it.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from kspipe.errors import ClusterError, ConfigError, check_integer
from kspipe.modes.role import ParameterSync, read_vars, write_vars
from kspipe.modes.summing import WorkerSum

STRATEGIES = ("sync", "async", "geo")
META_GRAD = "_meta_grad"

#: The worker's brpc client flags.  Paddle 2.6.2 reads them only from the descriptor that
#: ``init_worker`` parses (its ``init_gflags``; ``paddle.set_flags`` cannot reach them).
#: The first three are Paddle's own defaults for an empty ``init_gflags``, kept.
CLIENT_FLAGS = " ".join((
    "-max_body_size=314217728",
    "-socket_max_unwritten_bytes=2048000000",
    "-max_connection_pool_size=1950",
    "-pserver_push_dense_merge_limit=0",         # send each dense push, do not wait for 12
    "-pserver_async_push_dense_interval_ms=1",   # and look for pushes every 1 ms
))


def check_strategy(strategy: str, k_steps=1, what: str = "cluster.strategy") -> None:
    """The one check of a parameter-server strategy (config and OpenKS API alike)."""
    if strategy == "half_async":
        raise ConfigError(f"{what}=half_async: Paddle 2.6.2's fleet parameter server has no "
                          f"half-async mode (its DistributedStrategy selects only sync, async "
                          f"or geo); use async")
    if strategy not in STRATEGIES:
        raise ConfigError(f"{what}={strategy!r} is not one of "
                          f"{', '.join(STRATEGIES + ('half_async',))}")
    if strategy == "geo":
        check_integer(k_steps, "cluster.k_steps", 1)


#: The exchange's one table (flat): the parameters and the workers' push counts.
FLAT = "_kspipe_exchange"
#: A worker's push count goes back to 0 here (float32 counts exactly below 2**24).
WRAP = 1 << 20
#: A push the servers have not applied after this long is lost (or a server stalled).
PUSH_TIMEOUT_S = 120.0
#: Paddle 2.6.2's server applies a push to its slice of a dense table in this many parts,
#: one thread each (MemoryDenseTable's task pool), the parts of one push concurrently.
SERVER_PARTS = 10


class Layout:
    """Where each parameter, and each worker's push counts, lie in the exchange's flat
    table.

    Paddle's client splits a dense table of ``size`` values over the servers in slices of
    ``size // servers + 1`` (the last one shorter); a server splits its slice into
    :data:`SERVER_PARTS` parts as evenly as it can (the first ones one longer), and
    applies each push to each part on that part's own thread, in order.  Each part begins
    with one count per worker, which every push of the worker adds 1 to: a pull that
    reads count c in a part found that part's thread at or past the worker's c-th push, so
    every value of the part holds at least c - 1 of them.  Parameters take the other
    places in order; what is left at the end is padding.
    """

    def __init__(self, shapes: dict, workers: int, servers: int):
        self.shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        self.servers = servers
        weights = sum(int(np.prod(shape)) for shape in self.shapes.values())
        size = weights + workers * servers * SERVER_PARTS
        while min(end - start for start, end in self.slices(size)) < SERVER_PARTS * workers:
            size += 1  # every part holds the workers' counts
        self.size = size
        starts = [start + part for start, end in self.slices(size)
                  for part in part_starts(end - start)]
        self.counts = np.array([[at + w for at in starts] for w in range(workers)])
        free = np.ones(size, bool)
        free[self.counts.ravel()] = False
        self.weights = np.flatnonzero(free)[:weights]

    def slices(self, size: int) -> list:
        """``[(start, end)]`` of each server's slice of a table of ``size`` values."""
        per = size // self.servers + 1
        return [(s * per, min((s + 1) * per, size)) for s in range(self.servers)]

    def split(self, flat: np.ndarray) -> dict:
        """``{name: values}`` of the parameters in ``flat``."""
        values, at = {}, 0
        taken = flat[self.weights]
        for name, shape in self.shapes.items():
            n = int(np.prod(shape))
            values[name] = taken[at:at + n].reshape(shape)
            at += n
        return values

    def join(self, values: dict, flat: np.ndarray) -> np.ndarray:
        """A copy of ``flat`` with the parameters set from ``values``."""
        flat = flat.copy()
        flat[self.weights] = np.concatenate(
            [np.asarray(values[name], np.float32).ravel() for name in self.shapes])
        return flat


def part_starts(length: int) -> list:
    """Where each of a server's :data:`SERVER_PARTS` parts of a slice of ``length``
    values begins (the first ``length % SERVER_PARTS`` parts one value longer)."""
    base, longer = divmod(length, SERVER_PARTS)
    starts, at = [], 0
    for part in range(SERVER_PARTS):
        starts.append(at)
        at += base + (part < longer)
    return starts


class ParameterExchange:
    """Moves dense parameters between a worker and the servers.

    The meta program lives in a scope of its own, the worker's view of the servers'
    parameters, so the model's programs are never transpiled.  Build it in every role
    (servers take their tables from it), in a job whose fleet knows its workers and
    servers.
    """

    def __init__(self, shapes: dict):
        import paddle
        import paddle.distributed.fleet as fleet

        self.fleet = fleet
        self.layout = Layout(shapes, fleet.worker_num(), len(fleet.server_endpoints()))
        self.scope = paddle.static.Scope()
        self.runtime = None
        self.tables: dict = {}
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
            theta = paddle.static.create_parameter(
                [self.layout.size], "float32", name=FLAT,
                default_initializer=paddle.nn.initializer.Constant(0.0))
            grad = paddle.static.data(FLAT + META_GRAD, [self.layout.size], "float32")
            loss = paddle.sum(paddle.multiply(theta, grad))
            strategy = fleet.DistributedStrategy()
            strategy.a_sync = True  # tables that apply every push; kspipe adds the rest
            strategy.a_sync_configs = {"k_steps": 0}
            fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=1.0),
                                        strategy).minimize(loss)
            self.program = loss.block.program
            self.startup = paddle.static.default_startup_program()
        self.place = paddle.CPUPlace()
        self.exe = paddle.static.Executor(self.place)
        # a push is the program's send op alone, run on gradients written into the scope:
        # the forward and backward ops that make them equal to what is fed, and the
        # executor around them, cost ~1 ms a push
        from paddle.base import core

        self.senders = [core.Operator.create(op.desc.serialize_to_string())
                        for op in self.program.global_block().ops if op.type == "send"]

    def connect(self, values: dict) -> dict:
        """Meet the servers with worker 0's ``values``; return the servers' parameters."""
        import paddle

        self.exe.run(self.startup, scope=self.scope)
        self.hold(values)
        from paddle.distributed.ps.utils.public import get_the_one_recv_context

        runtime = self.fleet.fleet._runtime_handle
        runtime.ps_desc_builder.ps_desc.init_gflags = CLIENT_FLAGS
        with paddle.static.scope_guard(self.scope):
            self.fleet.init_worker(scopes=[self.scope])
        self.runtime = runtime
        # {table id: its variables}: the one flat table, for every write and pull
        self.tables = get_the_one_recv_context(runtime.context, split_dense_table=False)
        return self.get()

    def push(self, grads: dict, worker: int, pushed: int, wait: bool = False) -> None:
        """The servers do ``theta -= grads`` when the push arrives (within a few ms), and
        count it as ``worker``'s push number ``pushed + 1``; with ``wait``, return once
        it is applied (``client_flush``: at least 100 ms)."""
        change = self.layout.join(grads, np.zeros(self.layout.size, np.float32))
        before, after = pushed % WRAP, (pushed + 1) % WRAP
        change[self.layout.counts[worker]] = before - after  # theta -= g: the count goes up
        write_vars(self.scope, {FLAT + "@GRAD": change})
        for sender in self.senders:
            sender.run(self.scope, self.place)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait until the servers have applied every push of this worker."""
        self.runtime._worker.client_flush()

    def behind(self, worker: int, pushed: int) -> int:
        """How many of ``worker``'s ``pushed`` pushes some part of some server had not
        begun to apply at the last pull."""
        counts = self.flat()[self.layout.counts[worker]].astype(np.int64)
        return int(np.max((pushed - counts) % WRAP))

    def write(self, values: dict) -> None:
        """Set the servers' parameters to ``values``; return once every server holds them."""
        self.hold(values)
        for table_id, names in self.tables.items():
            self.runtime._worker.push_dense_params(self.scope, table_id, names)

    def pull(self) -> dict:
        """The servers' parameters."""
        for table_id, names in self.tables.items():
            self.runtime._worker.pull_dense_params(self.scope, table_id, names)
        return self.get()

    def get(self) -> dict:
        """The parameters as last pulled (or written)."""
        return self.layout.split(self.flat())

    def hold(self, values: dict) -> None:
        """Take ``values`` as the servers' (a worker that does not write them)."""
        self._set(self.layout.join(values, self.flat()))

    def flat(self) -> np.ndarray:
        return read_vars(self.scope, [FLAT])[FLAT]

    def _set(self, flat: np.ndarray) -> None:
        write_vars(self.scope, {FLAT: flat})

    def close(self, first: bool) -> None:
        """Leave the servers; the first worker (after the others) stops them."""
        if self.runtime is None:
            return
        if first:
            self.runtime._worker.stop_server()
        self.fleet.stop_worker()
        self.runtime = None


def pull_all_dense(fleet) -> None:
    """Copy every dense table from the servers into the worker's scopes (fleet.init_worker's)."""
    from paddle.distributed.ps.utils.public import get_the_one_recv_context

    rt = fleet.fleet._runtime_handle
    dense = get_the_one_recv_context(rt.context, split_dense_table=rt.is_heter_ps_mode)
    rt._pull_all_dense(rt.scopes, rt._send_ctx, dense)


class StrategyExchange(ParameterSync):
    """A worker's side of the strategy over a :class:`ParameterExchange`."""

    changes_parameters = True

    def __init__(self, role, shapes: dict, strategy: str, k_steps: int = 1,
                 wait_push: bool = False):
        check_strategy(strategy, k_steps)
        self.role = role
        self.names = list(shapes)
        self.exchange = ParameterExchange(shapes)
        self.strategy, self.k_steps, self.wait_push = strategy, k_steps, wait_push
        if strategy == "sync":
            self.k_steps = 1
        self.scope = None
        self.summing = None  # sync and geo: the workers' changes summed (WorkerSum)
        self.steps = 0  # updates since the last exchange
        self.pushed = 0  # async: this worker's pushes so far
        self.seconds: dict = {}  # time spent in each part of the exchanges so far

    @contextlib.contextmanager
    def timed(self, part: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started

    def connect(self, scope) -> None:
        """Worker 0's parameters become the servers'; every worker takes them."""
        self.scope = scope
        write_vars(scope, self.exchange.connect(read_vars(scope, self.names)))
        if self.strategy != "async":
            self.summing = WorkerSum(self.role)

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
        last = self.exchange.get()
        with self.timed("push"):
            self.exchange.push({n: last[n] - current[n] for n in self.names},
                               self.role.worker_index(), self.pushed, wait=self.wait_push)
            self.pushed += 1
        with self.timed("pull"):
            write_vars(scope, self._pull_bounded())
        self.steps = 0

    def _pull_bounded(self) -> dict:
        """The servers' parameters, pulled until every part of every server had begun to
        apply this worker's last push but one: every value holds all its pushes but at
        most the last two (Paddle's client may otherwise queue 14)."""
        worker, deadline = self.role.worker_index(), time.monotonic() + PUSH_TIMEOUT_S
        while True:
            values = self.exchange.pull()
            behind = self.exchange.behind(worker, self.pushed)
            if behind <= 1:
                return values
            if time.monotonic() > deadline:
                raise ClusterError(f"worker {worker}: the servers have not applied its push "
                                   f"{self.pushed - behind + 1} of {self.pushed} within "
                                   f"{PUSH_TIMEOUT_S:.0f} s (a push lost, or a server "
                                   f"stalled)")

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
            merged[n] = last[n] - mean[at:at + size].reshape(last[n].shape)
            at += size
        # The first worker's write returns once every server holds the round, and it joins
        # the next round only then; whoever reads the servers (finish, refresh) meets the
        # workers at a barrier first.  So no round is ever missing from what is read.
        if self.role.is_first_worker():
            with self.timed("write"):
                self.exchange.write(merged)
        else:
            self.exchange.hold(merged)
        write_vars(scope, merged)
        self.steps = 0

    def finish(self, scope) -> None:
        """Send what is still local, wait for every worker, take the final parameters."""
        if self.exchange.runtime is None:
            return
        if self.strategy == "async":
            self.exchange.flush()
        elif self.strategy == "geo":  # every worker joins the last round, steps or none
            self._round(scope, read_vars(scope, self.names))
        self.role.barrier_worker()
        write_vars(scope, self.exchange.pull())

    def refresh(self, scope) -> None:
        """Take the servers' parameters mid-training (async; sync and geo hold the last
        round's already, and geo's steps since then stay local)."""
        if self.exchange.runtime is not None and self.strategy == "async":
            self.exchange.flush()
            write_vars(scope, self.exchange.pull())

    def settle(self) -> None:
        """Before a checkpoint, every worker: the scope then holds the servers' parameters
        exactly, so the state written into the checkpoint is the job's one model.

        * async: every push in (each worker's flushed, then a barrier), then a pull (float32: a table the exchange moves is whole in every worker,
          where the servers' own files would keep 6 digits of it);
        * geo: a round, whatever ``k_steps`` says, so no worker's local steps are left out
          of the checkpoint.  The uninterrupted run makes the same round at the same
          checkpoint, so a run resumed from it repeats that run exactly;
        * sync: every round already ended so.
        """
        if self.exchange.runtime is None:
            return
        if self.strategy == "async":
            self.exchange.flush()
            self.role.barrier_worker()
            write_vars(self.scope, self.exchange.pull())
        elif self.strategy == "geo":  # every worker joins, steps since the last or none
            self._round(self.scope, read_vars(self.scope, self.names))

    def close(self, clean: bool = True) -> None:
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

    def backward(self, loss, startup_program=None, parameter_list=None, no_grad_set=None,
                 callbacks=None):
        return self._inner.backward(loss, startup_program, parameter_list, no_grad_set,
                                    callbacks)

    def apply_gradients(self, params_grads):
        import paddle

        ops = self._inner.apply_gradients(params_grads)
        params = [p for p, _ in params_grads]
        names = [p.name for p in params]
        self.sync = self._role.parameter_sync({p.name: list(p.shape) for p in params},
                                              **self._cluster)

        def after_step(*values):
            self.sync.step(values=dict(zip(names, (np.array(v) for v in values))))

        with params[0].block.program._optimized_guard([]):  # a for_test clone drops it
            paddle.static.py_func(after_step, x=params, out=None)
        return ops

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        params_grads = self.backward(loss, startup_program, parameter_list, no_grad_set)
        return self.apply_gradients(params_grads), params_grads
