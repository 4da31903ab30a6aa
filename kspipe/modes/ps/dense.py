"""The exchange's dense table on the servers: where each parameter lies in it, and a
worker's pushes, writes and pulls of it.

:class:`Layout` places the parameters and each worker's push counts in one flat table;
:class:`ParameterExchange` moves it (its strategies are :mod:`kspipe.modes.ps.exchange`'s).
Paddle's brpc client holds dense pushes back for merging (up to 12, or until a
``client_flush``, which polls every 100 ms); :data:`CLIENT_FLAGS` makes it send each push
at once.
"""

from __future__ import annotations

import numpy as np

from kspipe.modes.role import read_vars, write_vars

META_GRAD = "_meta_grad"

#: The worker's brpc client flags.  Paddle 2.6.2 reads them only from the descriptor that
#: ``init_worker`` parses (its ``init_gflags``; ``paddle.set_flags`` cannot reach them).
#: The first three are Paddle's own defaults for an empty ``init_gflags``, kept.
CLIENT_FLAGS = " ".join(
    (
        "-max_body_size=314217728",
        "-socket_max_unwritten_bytes=2048000000",
        "-max_connection_pool_size=1950",
        "-pserver_push_dense_merge_limit=0",  # send each dense push, do not wait for 12
        "-pserver_async_push_dense_interval_ms=1",  # and look for pushes every 1 ms
    )
)


#: The exchange's one table (flat): the parameters and the workers' push counts.
FLAT = "_kspipe_exchange"
#: A worker's push count goes back to 0 here (float32 counts exactly below 2**24).
WRAP = 1 << 20
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
        starts = [
            start + part for start, end in self.slices(size) for part in part_starts(end - start)
        ]
        self.counts = np.array([[at + w for at in starts] for w in range(workers)])
        #: the part (a column of ``counts``) that each value of the table lies in
        self.part_of = np.searchsorted(np.array(starts), np.arange(size), side="right") - 1
        free = np.ones(size, bool)
        free[self.counts.ravel()] = False
        self.weights = np.flatnonzero(free)[:weights]
        #: ``[(name, start, end, shape)]``: each parameter's run of the weights, in order
        self.runs, at = [], 0
        for name, shape in self.shapes.items():
            n = int(np.prod(shape))
            self.runs.append((name, at, at + n, shape))
            at += n

    def slices(self, size: int) -> list:
        """``[(start, end)]`` of each server's slice of a table of ``size`` values."""
        per = size // self.servers + 1
        return [(s * per, min((s + 1) * per, size)) for s in range(self.servers)]

    def split(self, flat: np.ndarray) -> dict:
        """``{name: values}`` of the parameters in ``flat``."""
        return self.unflatten(flat[self.weights])

    def join(self, values: dict, flat: np.ndarray) -> np.ndarray:
        """A copy of ``flat`` with the parameters set from ``values``."""
        flat = flat.copy()
        flat[self.weights] = self.flatten(values)
        return flat

    def flatten(self, values: dict) -> np.ndarray:
        """The parameters' ``values`` in one vector, as :attr:`weights` orders them."""
        return np.concatenate(
            [np.asarray(values[name], np.float32).ravel() for name in self.shapes]
        )

    def unflatten(self, vector: np.ndarray) -> dict:
        """``{name: values}`` of a :meth:`flatten`-ed vector (views of it)."""
        return {name: vector[start:end].reshape(shape) for name, start, end, shape in self.runs}


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
                [self.layout.size],
                "float32",
                name=FLAT,
                default_initializer=paddle.nn.initializer.Constant(0.0),
            )
            grad = paddle.static.data(FLAT + META_GRAD, [self.layout.size], "float32")
            loss = paddle.sum(paddle.multiply(theta, grad))
            strategy = fleet.DistributedStrategy()
            strategy.a_sync = True  # tables that apply every push; kspipe adds the rest
            strategy.a_sync_configs = {"k_steps": 0}
            fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=1.0), strategy).minimize(
                loss
            )
            self.program = loss.block.program
            self.startup = paddle.static.default_startup_program()
        self.place = paddle.CPUPlace()
        self.exe = paddle.static.Executor(self.place)
        # a push is the program's send op alone, run on gradients written into the scope:
        # the forward and backward ops that make them equal to what is fed, and the
        # executor around them, cost ~1 ms a push
        from paddle.base import core

        self.senders = [
            core.Operator.create(op.desc.serialize_to_string())
            for op in self.program.global_block().ops
            if op.type == "send"
        ]

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

    def push(self, grads: np.ndarray, worker: int, pushed: int, wait: bool = False) -> np.ndarray:
        """The servers do ``theta -= grads`` (the parameters' change, :meth:`Layout.flatten`-ed)
        when the push arrives (within a few ms), and count it as ``worker``'s push number
        ``pushed + 1``; with ``wait``, return once it is applied (``client_flush``: at least
        100 ms).  Returns the push as a change of the whole table (the counts' places
        included)."""
        change = np.zeros(self.layout.size, np.float32)
        change[self.layout.weights] = grads
        before, after = pushed % WRAP, (pushed + 1) % WRAP
        change[self.layout.counts[worker]] = before - after  # theta -= g: the count goes up
        write_vars(self.scope, {FLAT + "@GRAD": change})
        for sender in self.senders:
            sender.run(self.scope, self.place)
        if wait:
            self.flush()
        return change

    def flush(self) -> None:
        """Wait until the servers have applied every push of this worker."""
        self.runtime._worker.client_flush()

    def pull_own(self, worker: int, pushes: list) -> tuple:
        """The servers' parameters (:meth:`Layout.flatten`-ed), with ``worker``'s ``pushes``
        (``[(number, change)]``, oldest first) added where a part's server had not begun to
        apply them, and how many of them, from the oldest, every part had begun.  Every
        value then holds all of the worker's pushes but one at most (the one a part's
        server was applying)."""
        self._pull_tables()
        flat = self.flat()
        counts = flat[self.layout.counts[worker]].astype(np.int64)
        begun_everywhere = 0
        for i, (number, change) in enumerate(pushes):
            missing = (counts - number) % WRAP >= WRAP // 2  # this part's count is below
            if missing.any():
                flat -= change * missing[self.layout.part_of]  # theta -= g, where not begun
            elif begun_everywhere == i:
                begun_everywhere += 1
        return flat[self.layout.weights], begun_everywhere

    def write(self, values: dict) -> None:
        """Set the servers' parameters to ``values``; return once every server holds them."""
        self.hold(values)
        self.write_held()

    def write_held(self) -> None:
        """Set the servers' parameters to those last held; return once every server holds
        them."""
        for table_id, names in self.tables.items():
            self.runtime._worker.push_dense_params(self.scope, table_id, names)

    def pull(self) -> dict:
        """The servers' parameters."""
        self._pull_tables()
        return self.get()

    def _pull_tables(self) -> None:
        for table_id, names in self.tables.items():
            self.runtime._worker.pull_dense_params(self.scope, table_id, names)

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
