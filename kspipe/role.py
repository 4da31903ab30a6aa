"""The one-process role: the base class of every mode's role, and the role of a process
that is a job on its own.

A :class:`Role` is what a mode gives every workload (the role stage's result).  It is the
seed's RoleMaker (``is_worker``, ``worker_index``, ``split_files`` ...) and its
distributed algorithm (``distributed_optimizer``, ``init_worker``, ``stop_worker``,
``run_server``) in one object, so a workload asks its mode for what it needs and never
imports a mode's module; :class:`kspipe.contracts.Role` lists what it may ask.

* ``role.distributed_optimizer(optimizer)``: gradient-level data parallelism for any
  program with an optimiser; its ``minimize(loss)`` writes the mode's exchange into the
  program (nothing locally, an all-reduce of the gradients collectively, the strategy's
  exchange with the parameter servers).
* ``role.parameter_sync(shapes)``: model-level exchange, for workloads that make their own
  updates (Reptile's meta step): ``step()`` after each local update combines the workers'
  parameters as the mode does.
* ``role.embedding(...)``: an embedding table where the mode keeps it (on the servers in
  ``mode=pserver``).
* ``role.init_worker(scope)`` once the startup program ran, ``role.finish_training()``
  when the training loop ends (then every worker holds the final model), and
  ``role.stop_worker()`` (the pipeline calls it) bracket the training.
* ``role.settle_tables()``, ``save_tables``, ``load_tables`` and ``load_table_rows``: the
  tables a mode keeps outside the workers' scopes, in checkpoints and ``init_from=``.
* ``role.refuses(needs)``: the one place a mode says it cannot run a workload, and why.

This base class is ``mode=local`` (:mod:`kspipe.modes.local` returns it): one process, the
only worker, nothing to distribute.  It lives in the core, not with the modes, because a
workload uses it too when it runs outside a job (a test, a benchmark, a reference
computation: ``Role()``), and a workload may not import a mode.  What only the seed's
scripts use (``to_string``, ``barrier_all``, the parameters refreshed before a save) is in
the OpenKS layer, :mod:`kspipe.openks`.
"""

from __future__ import annotations

import numpy as np

from kspipe.errors import ConfigError
from kspipe.process import heartbeat


class Role:
    """A process's place in a job.  This base class is a one-process job: the only worker.

    The method names follow the seed's ``RoleMakerBase``; distributed modes subclass it.
    """

    mode = "local"
    is_cluster_job = False

    def __init__(self):
        self._syncs: list = []
        self._lookups: list = []  # the lookup ops of the tables :meth:`embedding` made
        self._sparse = True  # whether those tables take sparse gradients (:func:`sparse_safe`)

    # --- who am I --------------------------------------------------------------------

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

    def place(self):
        """The Paddle place this role computes on."""
        import paddle

        return paddle.CPUPlace()

    def split_files(self, files: list) -> list:
        """This worker's share of ``files``: contiguous blocks, the first ones one longer."""
        files = list(files)
        n, i = self.worker_num(), self.worker_index()
        size, extra = divmod(len(files), n)
        start = i * size + min(i, extra)
        return files[start : start + size + (1 if i < extra else 0)]

    # --- the workers' collectives (one process: over itself) -------------------------

    def all_gather(self, value) -> list:
        return [value]

    def all_reduce_worker(self, input, output, mode: str = "sum") -> None:
        check_reduce_mode(mode)
        np.copyto(np.asarray(output), np.asarray(input))

    def barrier_worker(self) -> None:
        pass

    # --- distribution ------------------------------------------------------------------

    def refuses(self, needs, cfg) -> str | None:
        """Why this mode cannot run a workload that ``needs`` these; None if it can."""
        return None

    def distributed_optimizer(self, optimizer, strategy=None, feeding: str = "executor"):
        """``optimizer``, made to train the job's workers together (here: as it is).

        :param strategy: the mode's options to override (e.g. ``{"strategy": "geo"}``).
        :param feeding: ``"executor"`` (``exe.run`` steps) or ``"dataset"``
            (``train_from_dataset``).
        """
        self._gradients_for(optimizer)
        return optimizer

    def parameter_sync(self, shapes: dict) -> ParameterSync:
        """An exchange of the parameters ``shapes`` names (here: nothing to exchange)."""
        return self._register(ParameterSync())

    def embedding(self, ids, size, param_attr, feeding: str = "executor"):
        """An embedding table of ``size`` = [rows, width], looked up with ``ids`` (int64, any
        shape); ``feeding`` as for :meth:`distributed_optimizer`.  Its gradient is sparse
        (the rows of a batch) unless the optimiser :meth:`distributed_optimizer` is given
        cannot update a table from its rows alone (:func:`sparse_safe`): then dense."""
        import paddle

        rows = paddle.static.nn.embedding(
            ids, size=size, is_sparse=self._sparse, param_attr=param_attr
        )
        self._lookups.append(
            next(op for op in reversed(rows.block.ops) if rows.name in op.output_arg_names)
        )
        return rows

    def _gradients_for(self, optimizer) -> None:
        """Before ``optimizer`` adds the backward pass: the tables :meth:`embedding` made,
        and makes from now on, get a dense gradient unless ``optimizer`` is
        :func:`sparse_safe`."""
        self._sparse = sparse_safe(optimizer)
        if not self._sparse:
            for op in self._lookups:
                op._set_attr("is_sparse", False)

    def init_worker(self, scope=None) -> None:
        """After the startup program: meet the other processes; ``scope`` then holds the
        job's shared starting parameters."""
        with heartbeat.phase("meeting the other workers", waiting=True):
            for sync in self._syncs:
                sync.connect(_scope(scope))

    def finish_training(self, scope=None) -> None:
        """After the training loop: wait for every worker; ``scope`` then holds the model
        all of them trained."""
        with heartbeat.phase("finishing training with the other workers", waiting=True):
            for sync in self._syncs:
                sync.finish(_scope(scope))

    # --- tables kept outside the workers (the parameter servers') --------------------

    def settle_tables(self) -> None:
        """Every worker calls it: return once every worker's updates are in the job's tables
        (then the first worker may save them with :meth:`save_tables`)."""
        with heartbeat.phase("settling the tables with the other workers", waiting=True):
            for sync in self._syncs:
                sync.settle()

    def save_tables(self, folder: str, mode: int = 0) -> None:
        """The first worker, after :meth:`settle_tables`: write the tables kept outside the
        workers' scopes into ``folder`` (each server its own shard; ``mode``: Paddle's
        save_persistables mode, 0 every row, 1 a delta).  Here: none are."""
        for sync in self._syncs:
            sync.save(folder, mode) if mode else sync.save(folder)

    def load_tables(self, folder: str, scope=None) -> None:
        """Every worker calls it, after :meth:`init_worker`: the tables that
        :meth:`save_tables` wrote into ``folder`` become the job's; ``scope`` then holds
        their dense part.  Raises :class:`ConfigError` for shards that are missing, damaged
        or of another layout or number of servers, before any is loaded."""
        for sync in self._syncs:
            sync.load(folder, _scope(scope))

    def end_day_tables(self, folder: str) -> None:
        """The first worker, after :meth:`settle_tables`, at a day's end: the tables kept
        outside the workers' scopes age a day and shrink.  Here: none are."""
        for sync in self._syncs:
            if hasattr(sync, "end_day"):
                sync.end_day(folder)

    def load_table_rows(self, rows: dict, folder: str) -> None:
        """Every worker calls it, after :meth:`init_worker`: the tables kept outside the
        workers' scopes get ``rows`` (``{table name: (ids, embedding rows)}``) with fresh
        optimiser state; ``folder`` (in the run folder) takes the files this needs."""
        if not rows:
            return
        takers = [sync for sync in self._syncs if hasattr(sync, "load_rows")]
        if not takers:
            raise ConfigError(
                f"mode={self.mode} keeps no tables outside the workers "
                f"({', '.join(sorted(rows))} given)"
            )
        for sync in takers:
            sync.load_rows(rows, folder)

    def stop_worker(self, clean: bool = True) -> None:
        """Leave the job (the pipeline calls it at the end of every worker's run).

        ``clean``: the run succeeded, so wait for the other workers to leave too; after a
        failure leave at once (the launcher stops the rest).
        """
        with heartbeat.phase("leaving the job with the other workers", waiting=True):
            for sync in self._syncs:
                sync.close(clean)
        self._syncs.clear()

    def run_server(self, reporter) -> None:
        raise ConfigError(f"mode={self.mode} has no servers")

    def _register(self, sync):
        self._syncs.append(sync)
        return sync


class ParameterSync:
    """How a worker's parameters meet the other workers'.  This one: alone, nothing to do.

    ``step(scope)`` after each local update; modes override ``connect``, ``step``,
    ``finish`` and ``close``, and set ``changes_parameters``.
    """

    changes_parameters = False  # whether ``step`` may change the parameters in the scope

    def connect(self, scope) -> None:
        pass

    def step(self, scope=None) -> None:
        pass

    def finish(self, scope) -> None:
        pass

    def settle(self) -> None:
        pass

    def save(self, folder: str) -> None:
        pass

    def load(self, folder: str, scope) -> None:
        pass

    def close(self, clean: bool = True) -> None:
        pass


def sparse_safe(optimizer) -> bool:
    """Whether Paddle 2.6.2's CPU update by ``optimizer`` from a sparse gradient (the rows
    of one batch) is sound.  For SGD, Momentum, Adagrad, RMSProp and Lamb it is the dense
    gradient's update, float rounding apart; Adam with ``lazy_mode=True`` updates the
    batch's rows only (the moments of the other rows wait for their next batch).  Adam's
    default (``lazy_mode=False``) reads past the end of the gradient's row list once it has
    passed the batch's last row and, where what it finds there names a later row, updates
    that row from memory past the gradient's values: NaN and huge moments, differing from
    one run to the next.  AdamW, Adamax and Adadelta refuse a sparse gradient; no other
    optimiser is known to take one."""
    import paddle

    if isinstance(optimizer, paddle.optimizer.Adam):
        return bool(getattr(optimizer, "_lazy_mode", False))
    return isinstance(
        optimizer,
        (
            paddle.optimizer.SGD,
            paddle.optimizer.Momentum,
            paddle.optimizer.Adagrad,
            paddle.optimizer.RMSProp,
            paddle.optimizer.Lamb,
        ),
    )


def check_reduce_mode(mode: str) -> None:
    if mode not in ("sum", "min", "max"):
        raise ValueError(f"all_reduce_worker mode must be sum, min or max, not {mode!r}")


def _scope(scope):
    import paddle

    return scope if scope is not None else paddle.static.global_scope()
