"""Fleet's own tables, for workloads trained with ``train_from_dataset``: the async
transpiling (:class:`FleetTables`) and the servers' table files a checkpoint holds (each
server's shard of every table, a manifest beside them, a sparse table's rows as text).
"""

from __future__ import annotations

import json
import os
import re
import shutil

from kspipe.errors import ClusterError, ConfigError
from kspipe.modes.ps.dense import CLIENT_FLAGS, pull_all_dense
from kspipe.modes.role import ParameterSync

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
    return {op.input("W")[0] for op in program.global_block().ops
            if op.type == "lookup_table" and op.attr("is_distributed")}


def pushes_counted(scope) -> float:
    """This worker's dense pushes so far, as its counter in ``scope`` says."""
    import numpy as np

    return float(np.array(scope.find_var(PUSHES).get_tensor())[0])


class FleetTables(ParameterSync):
    """Fleet's own async transpiling, for workloads trained with ``train_from_dataset``."""

    def __init__(self, role, optimizer, resumed: str | None = None):
        self.role, self._inner = role, optimizer
        self.resumed = resumed  # the tables the job resumes from (their folder), if any
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
            counter = paddle.static.create_global_var([1], 0.0, "float64", persistable=True,
                                                      name=PUSHES)
            paddle.increment(counter)
        return result

    def resume_dense_powers(self, pushes: int) -> None:
        """A server's dense tables start with Adam's powers where ``pushes`` pushes left
        them (Paddle saves and loads a dense table's parameters and moments, not its powers:
        a resumed table would start Adam's bias correction again, with steps ~3x smaller).
        The table takes its first values from the startup program's ``fill_constant`` ops,
        when the server starts."""
        context = self.role.fleet.fleet._runtime_handle.context
        for main, startup in zip(context["origin_main_programs"],
                                 context["origin_startup_programs"]):
            sparse = distributed_tables(main)
            powers = {op.input(name)[0]: beta for op in main.global_block().ops
                      if op.type == "adam" and op.input("Param")[0] not in sparse
                      for name, beta in DENSE_ADAM_BETAS.items()}
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
        servers = len(self.role.get_pserver_endpoints())
        for name in sorted(distributed_tables(program)):
            table = strategy.sparse_table_configs.add()
            table.table_name = name
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

    def save(self, folder: str) -> None:
        """Every server writes its shard of every table into ``folder``; a manifest beside
        them records the layout, the servers and each file's size, for :meth:`load`."""
        os.makedirs(folder, exist_ok=True)
        self.role.fleet.fleet._runtime_handle._worker.save_all_model(folder, 0)
        servers = len(self.role.get_pserver_endpoints())
        missing = missing_shard(folder, self.layout(), servers)
        if missing:  # a server died while saving: this checkpoint must not be completed
            raise ClusterError(f"{missing}: the servers' tables were not all saved (a "
                               f"server that could not write them, or died, says why in "
                               f"its log), so the checkpoint was left incomplete")
        write_manifest(folder, self.layout(), servers, self.rules(), self.pushes)

    def load(self, folder: str, scope) -> None:
        """The tables saved in ``folder`` become the servers' (checked first); every worker
        then takes their dense part."""
        self.role.barrier_worker()
        if self.role.is_first_worker():
            check_manifest(folder, len(self.role.get_pserver_endpoints()), self.layout())
            self.role.fleet.fleet._runtime_handle._worker.load_model(folder, 0)
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
            ids = write_table_rows(folder, rows, self.layout(), self.rules(),
                                   len(self.role.get_pserver_endpoints()))
            for table_id in ids:  # returns once the servers have read their files
                self.role.fleet.fleet._runtime_handle._worker.load_one_table(table_id, folder, 0)
            shutil.rmtree(folder, ignore_errors=True)
        self.role.barrier_worker()

    def layout(self) -> list:
        """The job's tables as the servers hold them: id, class, name and widths."""
        return sorted({(t.table_id, t.table_class, t.common.table_name, t.accessor.fea_dim,
                        t.accessor.embedx_dim, tuple(t.common.dims)) for t in self._tables()})

    def rules(self) -> dict:
        """Each sparse table's optimiser rules on the servers, as a row's state needs them:
        ``{name: [embed rule, embedx rule, beta1, beta2]}``."""
        return {t.common.table_name: [t.accessor.embed_sgd_param.name,
                                      t.accessor.embedx_sgd_param.name,
                                      t.accessor.embedx_sgd_param.adam.beta1_decay_rate,
                                      t.accessor.embedx_sgd_param.adam.beta2_decay_rate]
                for t in self._tables() if t.table_class == SPARSE_TABLE}

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


MANIFEST = "manifest.json"
SPARSE_TABLE = "MemorySparseTable"


def write_manifest(folder: str, layout: list, servers: int, rules: dict,
                   dense_pushes: int = 0) -> None:
    """``folder/manifest.json``: the tables' layout and rules, the servers, every file's
    size and the dense pushes the tables took (Adam's powers, which Paddle does not save)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"servers": servers, "layout": [list(t) for t in layout], "rules": rules,
                   "files": files, "dense_pushes": dense_pushes}, f)


def read_manifest(folder: str) -> dict:
    """The manifest of the tables in ``folder`` (checked by :func:`check_manifest`)."""
    with open(os.path.join(folder, MANIFEST)) as f:
        return json.load(f)


# --- a sparse table's rows in the servers' own files ---------------------------------
#
# A server writes each row of a sparse table (Paddle's CtrCommonAccessor) as one text line:
# the id, then slot, unseen days, delta score, show, click, embed_w, the embed rule's state,
# the embedx_w values and the embedx rule's state.  The embedding row a lookup returns is
# embed_w followed by embedx_w.  Row k lives on server k % servers.

HEADER = 5  # slot, unseen days, delta score, show, click


def rule_state(rule: str, width: int, beta1: float, beta2: float) -> list:
    """A fresh row's optimiser state under the server rule ``rule`` for ``width`` weights."""
    fresh = {"SparseNaiveSGDRule": [], "SparseAdaGradSGDRule": [0.0],
             "StdAdaGradSGDRule": [0.0] * width,
             "SparseAdamSGDRule": [0.0] * (2 * width) + [beta1, beta2],
             "SparseSharedAdamSGDRule": [0.0, 0.0, beta1, beta2]}
    if rule not in fresh:
        raise ConfigError(f"the servers' sparse rule {rule} is not one kspipe can write "
                          f"rows for ({', '.join(fresh)})")
    return fresh[rule]


def read_table_rows(folder: str) -> dict:
    """``{table name: (ids, embedding rows)}`` of every sparse table saved in ``folder``
    (checked against its manifest first)."""
    import gzip

    import numpy as np

    with open(os.path.join(folder, MANIFEST)) as f:
        saved = json.load(f)
    check_manifest(folder, saved.get("servers"))
    if "rules" not in saved:
        raise ConfigError(f"{os.path.join(folder, MANIFEST)}: written before kspipe recorded "
                          f"the tables' rules: these tables can only be resumed")
    tables = {}
    for table_id, _, name, _, embedx, _ in (t for t in saved["layout"] if t[1] == SPARSE_TABLE):
        embed_rule, embedx_rule, beta1, beta2 = saved["rules"][name]
        embedx_at = HEADER + 1 + len(rule_state(embed_rule, 1, beta1, beta2))
        ids, rows = [], []
        shards = os.path.join(folder, f"{table_id:03d}")
        for file in sorted(os.listdir(shards)):
            with gzip.open(os.path.join(shards, file), "rt") as lines:
                for line in lines:
                    values = line.split()
                    ids.append(int(values[0]))
                    rows.append([values[1 + HEADER]] + values[1 + embedx_at:
                                                               1 + embedx_at + embedx])
        tables[name] = (np.array(ids, np.int64),
                        np.array(rows, np.float32).reshape(len(ids), embedx + 1))
    return tables


def write_table_rows(folder: str, tables: dict, layout: list, rules: dict,
                     servers: int) -> list:
    """Write ``tables`` (``{name: (ids, rows)}``) as the servers' files of the job's
    ``layout``, split over ``servers``; return the table ids written."""
    import gzip

    import numpy as np

    written = []
    for table_id, _, name, _, embedx, _ in (t for t in layout if t[1] == SPARSE_TABLE):
        if name not in tables:
            continue
        ids, rows = tables[name]
        embed_rule, embedx_rule, beta1, beta2 = rules[name]
        if rows.shape[1] != embedx + 1:
            raise ConfigError(f"table {name}: rows of width {rows.shape[1]} given, the "
                              f"servers hold {embedx + 1}")
        embed_state = [repr(v) for v in rule_state(embed_rule, 1, beta1, beta2)]
        embedx_state = [repr(v) for v in rule_state(embedx_rule, embedx, beta1, beta2)]
        shards = os.path.join(folder, f"{table_id:03d}")
        os.makedirs(shards, exist_ok=True)
        for server in range(servers):
            with gzip.open(os.path.join(shards, f"part-{server:03d}-{server:05d}.gz"), "wt",
                           compresslevel=1) as f:
                for i in np.flatnonzero(ids % servers == server):
                    weights = [repr(float(v)) for v in rows[i]]
                    f.write(" ".join([str(int(ids[i])), "0", "0", "0", "0", "0", weights[0],
                                      *embed_state, *weights[1:], *embedx_state]) + "\n")
        written.append(table_id)
    return written


SHARD_FILE = re.compile(r"part-(\d+)")  # part-<server>.gz, part-<server>-<shard>.gz


def missing_shard(folder: str, layout: list, servers: int) -> str:
    """The first table shard that is not in ``folder`` (each server writes
    ``<table id>/part-<server>...`` of every table of values), as a message; '' if none is
    missing."""
    for table in layout:
        if not table[1].endswith(("SparseTable", "DenseTable")):
            continue  # tables that hold no values (the barrier table)
        shards = os.path.join(folder, f"{table[0]:03d}")
        names = os.listdir(shards) if os.path.isdir(shards) else []
        written = {int(m.group(1)) for m in map(SHARD_FILE.match, names) if m}
        for server in range(servers):
            if server not in written:
                return f"{shards}: server {server}'s shard of table {table[2]} is missing"
    return ""


def check_manifest(folder: str, servers: int, layout: list | None = None) -> None:
    """One line, naming the file, for tables this job cannot load from ``folder`` (of
    another number of servers, a shard missing or damaged, and, given the job's ``layout``,
    of another model)."""
    file = os.path.join(folder, MANIFEST)
    try:
        with open(file) as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read the servers' tables' manifest {file} "
                          f"({type(err).__name__}): was the checkpoint written by a "
                          f"mode=pserver job?") from err
    if saved.get("servers") != servers:
        raise ConfigError(f"{file}: the tables were saved by {saved.get('servers')} server(s), "
                          f"this job has {servers}: resume it with servers="
                          f"{saved.get('servers')}, or start a new run from it with "
                          f"init_from= (any number of servers)")
    if layout is not None and [tuple(t[:5]) + (tuple(t[5]),)
                               for t in saved.get("layout", [])] != list(layout):
        raise ConfigError(f"{file}: the tables were saved by another model (another table "
                          f"layout: {saved.get('layout')} there, {[list(t) for t in layout]} "
                          f"here)")
    missing = missing_shard(folder, saved.get("layout", []), servers)
    if missing:
        raise ConfigError(missing)
    for name, size in sorted(saved.get("files", {}).items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: a server's table shard is missing")
        if os.path.getsize(path) != size:
            raise ConfigError(f"{path}: a server's table shard is damaged ({os.path.getsize(path)} "
                              f"bytes, {size} were written)")
