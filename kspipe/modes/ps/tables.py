"""Fleet's own tables, for workloads trained with ``train_from_dataset``: the async
transpiling (:class:`FleetTables`), whose servers write and load the table files a
checkpoint holds (what those files are, and how kspipe checks and reads them:
:mod:`kspipe.checkpoint.tables`).
"""

from __future__ import annotations

import os
import shutil

from kspipe.checkpoint.tables import (
    SPARSE_TABLE,
    check_manifest,
    missing_shard,
    read_manifest,
    reshard,
    write_manifest,
    write_table_rows,
)
from kspipe.errors import ClusterError
from kspipe.modes.ps.dense import CLIENT_FLAGS, pull_all_dense
from kspipe.modes.role import ParameterSync

#: The run folder's copy of resumed tables split anew for this job's servers, while they load.
RESHARDED = "resharded-tables"
#: A worker's dense pushes so far (an ``increment`` op in its program, once per batch).
PUSHES = "_kspipe_dense_pushes"
#: Paddle 2.6.2's dense tables apply Adam with betas of their own (``DAdam``: 0.9 and
#: 0.999, whatever the optimiser's), and multiply its powers once for each of the 10 parts
#: of the table that a push updates on a thread of its own (``task_pool_size_``).
DENSE_ADAM_BETAS = {"Beta1Pow": 0.9, "Beta2Pow": 0.999}
POWERS_PER_PUSH = 10


def distributed_tables(program) -> set:
    """The sparse tables on the servers that ``program`` looks ids up in (the tables
    ``role.embedding`` made: ``sparse_embedding``)."""
    return {
        op.input("W")[0]
        for op in program.global_block().ops
        if op.type == "lookup_table" and op.attr("is_distributed")
    }


def pushes_counted(scope) -> float:
    """This worker's dense pushes so far, as its counter in ``scope`` says."""
    import numpy as np

    return float(np.array(scope.find_var(PUSHES).get_tensor())[0])


class FleetTables(ParameterSync):
    """Fleet's own async transpiling, for workloads trained with ``train_from_dataset``."""

    def __init__(
        self,
        role,
        optimizer,
        resumed: str | None = None,
        run_dir: str = ".",
        tables: dict | None = None,
    ):
        self.role, self._inner = role, optimizer
        self.tables = tables or {}  # {table name: its TableParameter fields, as a dict}
        self.resumed = resumed  # the tables the job resumes from (their folder), if any
        self.run_dir = run_dir  # where tables saved by another number of servers are split
        self.connected = False
        self.pushes = 0  # the dense pushes every worker made since the tables were new
        self.counted = 0.0  # this worker's counter when the count was last taken

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        import paddle

        strategy = self.role.fleet.DistributedStrategy()
        strategy.a_sync = True
        self.one_shard_per_server(strategy, loss.block.program)
        result = self.role.fleet.distributed_optimizer(self._inner, strategy).minimize(loss)
        self.program = loss.block.program  # fleet's rewritten worker program
        self.startup = paddle.static.default_startup_program()
        if self.role.is_server() and self.resumed:
            self.resume_dense_powers(read_manifest(self.resumed).get("dense_pushes", 0))
        with paddle.static.program_guard(self.program, self.startup):
            counter = paddle.static.create_global_var(
                [1], 0.0, "float64", persistable=True, name=PUSHES
            )
            paddle.increment(counter)
        return result

    def resume_dense_powers(self, pushes: int) -> None:
        """A server's dense tables start with Adam's powers where ``pushes`` pushes left
        them (Paddle saves and loads a dense table's parameters and moments, not its powers:
        a resumed table would start Adam's bias correction again, with steps ~3x smaller).
        The table takes its first values from the startup program's ``fill_constant`` ops,
        when the server starts."""
        context = self.role.fleet.fleet._runtime_handle.context
        for main, startup in zip(
            context["origin_main_programs"], context["origin_startup_programs"]
        ):
            sparse = distributed_tables(main)
            powers = {
                op.input(name)[0]: beta
                for op in main.global_block().ops
                if op.type == "adam" and op.input("Param")[0] not in sparse
                for name, beta in DENSE_ADAM_BETAS.items()
            }
            for op in startup.global_block().ops:
                if op.type == "fill_constant" and op.output("Out")[0] in powers:
                    beta = powers[op.output("Out")[0]]
                    op._set_attr("value", op.attr("value") * beta ** (POWERS_PER_PUSH * pushes))

    def one_shard_per_server(self, strategy, program) -> None:
        """Each sparse table in one shard per server, not fleet's default 1000.

        Paddle 2.6.2's server table runs every pull and push as one task per local shard,
        empty shards included, on a pool of 24 threads per table: with 1000 shards, one
        batch's pulls and pushes of three tables were 6,000 thread hand-offs, and on a
        2-core host the workers waited for them 82% of the time (BENCHMARKS.md, ctr on
        parameter servers).  With one shard a request is one task.  Clients send key k
        to server k % servers, so the keys still spread over every server.
        """
        from google.protobuf import json_format

        servers = len(self.role.get_pserver_endpoints())
        for name in sorted(distributed_tables(program)):
            table = strategy.sparse_table_configs.add()
            json_format.ParseDict(self.tables.get(name, {}), table)
            table.table_name = name
            if not table.HasField("shard_num"):
                table.shard_num = servers

    def connect(self, scope) -> None:
        import paddle

        # each dense push sent on its own (Paddle's client merges up to 12 by default): one
        # push per batch, each one Adam step on the servers, so the pushes can be counted
        self.role.fleet.fleet._runtime_handle.ps_desc_builder.ps_desc.init_gflags = CLIENT_FLAGS
        with paddle.static.scope_guard(scope):
            self.role.fleet.init_worker(scopes=[scope])
        self.scope = scope
        self.connected = True

    def finish(self, scope) -> None:
        self.settle()  # every push is in: the servers hold the final model

    def settle(self) -> None:
        """This worker's pushes sent and applied, then everyone's; the scope then holds the
        servers' dense parameters (what a checkpoint writes), and :attr:`pushes` every
        worker's dense pushes."""
        import numpy as np

        self.role.fleet.fleet._runtime_handle._worker.client_flush()
        counter = pushes_counted(self.scope)
        made, total = np.array([counter - self.counted]), np.zeros(1)
        self.role.all_reduce_worker(made, total, "sum")  # a barrier of the workers too
        self.pushes += int(round(total[0]))
        self.counted = counter
        pull_all_dense(self.role.fleet)

    def save(self, folder: str, mode: int = 0) -> None:
        """Every server writes its shard of every table into ``folder`` (``mode``: Paddle's
        ``save_persistables`` mode: 0 every row, 1 a delta, the rows whose delta score
        reached ``delta_threshold`` since the last one, each then reset to 0); a manifest
        beside them records the layout, the servers and each file's size, for :meth:`load`."""
        os.makedirs(folder, exist_ok=True)
        self.role.fleet.fleet._runtime_handle._worker.save_all_model(folder, mode)
        servers = len(self.role.get_pserver_endpoints())
        missing = missing_shard(folder, self.layout(), servers)
        if missing:  # a server died while saving: this checkpoint must not be completed
            raise ClusterError(
                f"{missing}: the servers' tables were not all saved (a "
                f"server that could not write them, or died, says why in "
                f"its log), so the checkpoint was left incomplete"
            )
        write_manifest(folder, self.layout(), servers, self.rules(), self.pushes)

    def end_day(self, folder: str) -> None:
        """The first worker, at a day's end: every row ages a day (Paddle's only day clock:
        a save of mode 3 writes every row into ``folder``, removed here, then adds one to
        each row's unseen days), then each sparse table shrinks (its accessor decays show
        and click by ``show_click_decay_rate`` and deletes rows scoring below
        ``delete_threshold`` or unseen for more than ``delete_after_unseen_days``).  Fleet's
        own ``shrink`` is not used: it meets the workers through gloo's barrier and its
        threshold argument is ignored."""
        worker = self.role.fleet.fleet._runtime_handle._worker
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        try:
            worker.save_all_model(folder, 3)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        for table_id, kind, *_ in self.layout():
            if kind == SPARSE_TABLE:
                worker.shrink_sparse_table(table_id, 0)

    def load(self, folder: str, scope) -> None:
        """The tables saved in ``folder`` become the servers' (checked first); every worker
        then takes their dense part.  Tables saved by another number of servers are split
        anew for this job's first (:func:`kspipe.checkpoint.tables.reshard`, into the run
        folder, removed once the servers have read them)."""
        self.role.barrier_worker()
        if self.role.is_first_worker():
            servers = len(self.role.get_pserver_endpoints())
            check_manifest(folder, None)  # whole, as saved
            split, loaded = None, folder
            if read_manifest(folder)["servers"] != servers:
                loaded = split = reshard(
                    folder, os.path.join(self.run_dir, RESHARDED), servers, self.layout()
                )
            check_manifest(loaded, servers, self.layout())
            self.role.fleet.fleet._runtime_handle._worker.load_model(loaded, 0)
            if split:  # load_model returns once every server has read its files
                shutil.rmtree(split, ignore_errors=True)
        self.role.barrier_worker()
        pull_all_dense(self.role.fleet)
        self.pushes = read_manifest(folder).get("dense_pushes", 0)
        self.counted = pushes_counted(scope)

    def load_rows(self, rows: dict, folder: str) -> None:
        """Every worker calls it, after :meth:`connect`: the servers' sparse tables get
        ``rows`` (``{table name: (ids, embedding rows)}``), each row with fresh optimiser
        state; the shards are written into ``folder`` first, split as this job's servers
        hold them, and removed once the servers have read them."""
        self.role.barrier_worker()
        if self.role.is_first_worker():
            ids = write_table_rows(
                folder, rows, self.layout(), self.rules(), len(self.role.get_pserver_endpoints())
            )
            for table_id in ids:  # returns once the servers have read their files
                self.role.fleet.fleet._runtime_handle._worker.load_one_table(table_id, folder, 0)
            shutil.rmtree(folder, ignore_errors=True)
        self.role.barrier_worker()

    def layout(self) -> list:
        """The job's tables as the servers hold them: id, class, name and widths."""
        return sorted(
            {
                (
                    t.table_id,
                    t.table_class,
                    t.common.table_name,
                    t.accessor.fea_dim,
                    t.accessor.embedx_dim,
                    tuple(t.common.dims),
                )
                for t in self._tables()
            }
        )

    def rules(self) -> dict:
        """Each sparse table's optimiser rules on the servers, as a row's state needs them:
        ``{name: [embed rule, embedx rule, beta1, beta2]}``."""
        return {
            t.common.table_name: [
                t.accessor.embed_sgd_param.name,
                t.accessor.embedx_sgd_param.name,
                t.accessor.embedx_sgd_param.adam.beta1_decay_rate,
                t.accessor.embedx_sgd_param.adam.beta2_decay_rate,
            ]
            for t in self._tables()
            if t.table_class == SPARSE_TABLE
        }

    def _tables(self):
        desc = self.role.fleet.fleet._runtime_handle.ps_desc_builder.ps_desc
        return desc.server_param.downpour_server_param.downpour_table_param

    def close(self, clean: bool = True) -> None:
        if not self.connected:
            return
        if clean:
            self.role.barrier_worker()
        if self.role.is_first_worker():
            self.role.fleet.fleet._runtime_handle._worker.stop_server()
        self.role.fleet.stop_worker()
        self.connected = False
