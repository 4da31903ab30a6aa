"""Mode ``pserver``: parameter servers (Paddle fleet's the_one_ps, brpc) for any workload.

Started without ``TRAINING_ROLE`` in the environment, the role stage is a launcher: it
starts ``servers`` server and ``workers`` worker processes (``python -m kspipe.worker``,
each playing its role) and watches them.  In a server or worker process the role is a
:class:`PserverRole`, which distributes the workload's training:

* ``distributed_optimizer(opt)``: the optimiser steps on the worker, then the strategy's
  exchange (:mod:`kspipe.modes.exchange`) sends the change to the servers and takes the
  servers' parameters back; for a workload that trains with ``train_from_dataset`` it is
  fleet's own async transpiling instead (the device worker pulls and pushes every batch,
  embedding lookups go to the servers' sparse tables);
* ``parameter_sync(shapes)``: the same exchange for a workload's own updates (Reptile's
  meta step);
* ``embedding``: a table on the servers: moved by the exchange (``exe.run``), or one of
  fleet's sparse tables (``train_from_dataset``);
* ``run_server``: the one server loop; every workload's servers run it.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from kspipe import checkpoint, hookimpl
from kspipe.errors import ClusterError, ConfigError
from kspipe.files import user_path
from kspipe.job import check_environment, role_from_environment
from kspipe.modes.exchange import ExchangingOptimizer, StrategyExchange, check_strategy, \
    pull_all_dense
from kspipe.modes.hosts import job_hosts
from kspipe.endpoints import process_count
from kspipe.modes.launch import Launcher, job_plan, run_cluster
from kspipe.modes.role import ParameterSync, Role, check_reduce_mode
from kspipe.modes.slurm import check_launcher


@hookimpl
def kspipe_check_config(cfg):
    if cfg.stages.role == "pserver":
        check_strategy(cfg.cluster.strategy, cfg.cluster.k_steps)


@hookimpl
def kspipe_assign_role(cfg):
    if role_from_environment("pserver"):
        check_environment("pserver")
        return PserverRole(dict(strategy=cfg.cluster.strategy, k_steps=cfg.cluster.k_steps,
                                wait_push=cfg.cluster.wait_push))
    return PserverLauncher(cfg)


def refusal(strategy: str, needs) -> str | None:
    """Why a parameter-server job of ``strategy`` cannot run a workload that ``needs``
    these; None if it can."""
    if "dataset_training" in needs and strategy != "async":
        return (f"cluster.strategy={strategy}: training with train_from_dataset runs on "
                f"fleet's own async mode on Paddle 2.6.2 (its sync crashes in "
                f"send_barrier and its geo mode sends no dense parameters)")
    return None


class PserverRole(Role):
    """This process's role in a parameter-server job, read from Paddle's environment."""

    mode = "pserver"

    def __init__(self, cluster: dict | None = None):
        super().__init__()
        import paddle
        import paddle.distributed.fleet as fleet

        paddle.enable_static()
        self.fleet = fleet
        self.cluster = cluster or {"strategy": "async"}
        fleet.init(fleet.PaddleCloudRoleMaker(is_collective=False))

    # who am I
    def is_worker(self):
        return self.fleet.is_worker()

    def is_server(self):
        return self.fleet.is_server()

    def worker_num(self):
        return self.fleet.worker_num()

    def worker_index(self):
        return self.fleet.worker_index() if self.is_worker() else -1

    def server_index(self):
        return self.fleet.server_index() if self.is_server() else -1

    def get_trainer_endpoints(self):
        return list(self.fleet.worker_endpoints())

    def get_pserver_endpoints(self):
        return list(self.fleet.server_endpoints())

    # the workers' collectives, through fleet's gloo
    def all_gather(self, value) -> list:
        return list(self.fleet.util.all_gather(value, comm_world="worker"))

    def all_reduce_worker(self, input, output, mode: str = "sum") -> None:
        import numpy as np

        check_reduce_mode(mode)
        result = self.fleet.util.all_reduce(np.asarray(input), mode=mode, comm_world="worker")
        np.copyto(np.asarray(output), np.asarray(result).reshape(np.shape(output)))

    def barrier_worker(self) -> None:
        self.fleet.util.barrier("worker")

    def barrier_all(self) -> None:
        self.fleet.util.barrier("worker")  # servers sit in run_server: workers are "all"

    # distribution
    def refuses(self, needs, cfg) -> str | None:
        return refusal(self.cluster["strategy"], needs)

    def distributed_optimizer(self, optimizer, strategy=None, feeding: str = "executor"):
        if feeding == "dataset":
            return self._register(FleetTables(self, optimizer))
        return ExchangingOptimizer(self, optimizer, dict(self.cluster, **(strategy or {})))

    def parameter_sync(self, shapes: dict, strategy: str | None = None, k_steps: int | None = None,
                       wait_push: bool | None = None) -> ParameterSync:
        c = self.cluster
        return self._register(StrategyExchange(
            self, shapes, strategy or c["strategy"], k_steps or c.get("k_steps", 1),
            c.get("wait_push", False) if wait_push is None else wait_push))

    def embedding(self, ids, size, param_attr, feeding: str = "executor"):
        """A table on the servers.  Fed by ``exe.run`` (``feeding="executor"``): a dense
        table that the strategy exchange moves with the other parameters (ids of any shape,
        as locally).  Fed by ``train_from_dataset`` (``"dataset"``): one of fleet's sparse
        tables, rows made as ids are first seen and moved per batch."""
        import paddle

        if feeding == "dataset":
            return paddle.static.nn.sparse_embedding(ids, size=size, param_attr=param_attr)
        return super().embedding(ids, size, param_attr, feeding)

    def run_server(self, reporter) -> None:
        """The one server loop: serve the tables the compile stage defined until stopped."""
        from kspipe import stopping

        self.fleet.init_server()
        reporter.say(f"server {self.server_index()} ready")
        stopping.default()  # run_server blocks in C++: let SIGTERM end the process
        self.fleet.run_server()


class FleetTables(ParameterSync):
    """Fleet's own async transpiling, for workloads trained with ``train_from_dataset``."""

    def __init__(self, role, optimizer):
        self.role, self._inner = role, optimizer
        self.connected = False

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        import paddle

        strategy = self.role.fleet.DistributedStrategy()
        strategy.a_sync = True
        self.one_shard_per_server(strategy, loss.block.program)
        result = self.role.fleet.distributed_optimizer(self._inner, strategy).minimize(loss)
        self.program = loss.block.program  # fleet's rewritten worker program
        self.startup = paddle.static.default_startup_program()
        return result

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
        tables = {op.input("W")[0] for op in program.global_block().ops
                  if op.type == "lookup_table" and op.attr("is_distributed")}
        for name in sorted(tables):  # the tables role.embedding made (sparse_embedding)
            table = strategy.sparse_table_configs.add()
            table.table_name = name
            table.shard_num = servers

    def connect(self, scope) -> None:
        import paddle

        with paddle.static.scope_guard(scope):
            self.role.fleet.init_worker(scopes=[scope])
        self.connected = True

    def finish(self, scope) -> None:
        self.settle()  # every push is in: the servers hold the final model

    def settle(self) -> None:
        """This worker's pushes sent (the client holds them back to merge), then everyone's;
        the scope then holds the servers' dense parameters (what a checkpoint writes)."""
        self.role.fleet.fleet._runtime_handle._worker.client_flush()
        self.role.barrier_worker()
        pull_all_dense(self.role.fleet)

    def save(self, folder: str) -> None:
        """Every server writes its shard of every table into ``folder``; a manifest beside
        them records the layout, the servers and each file's size, for :meth:`load`."""
        os.makedirs(folder, exist_ok=True)
        self.role.fleet.fleet._runtime_handle._worker.save_all_model(folder, 0)
        servers = len(self.role.get_pserver_endpoints())
        missing = missing_shard(folder, self.layout(), servers)
        if missing:  # a server died while saving: this checkpoint must not be completed
            raise ClusterError(f"{missing}: the servers' tables were not all saved, so the "
                               f"checkpoint was left incomplete")
        write_manifest(folder, self.layout(), servers, self.rules())

    def load(self, folder: str, scope) -> None:
        """The tables saved in ``folder`` become the servers' (checked first); every worker
        then takes their dense part."""
        self.role.barrier_worker()
        if self.role.is_first_worker():
            check_manifest(folder, len(self.role.get_pserver_endpoints()), self.layout())
            self.role.fleet.fleet._runtime_handle._worker.load_model(folder, 0)
        self.role.barrier_worker()
        pull_all_dense(self.role.fleet)

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


def write_manifest(folder: str, layout: list, servers: int, rules: dict) -> None:
    """``folder/manifest.json``: the tables' layout and rules, the servers and every file's
    size."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"servers": servers, "layout": [list(t) for t in layout], "rules": rules,
                   "files": files}, f)


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


class PserverLauncher(Launcher):
    """Starts this host's servers and workers of the job and watches them."""

    mode = "pserver"

    def __init__(self, cfg):
        check_launcher(cfg, process_count(cfg.workers, "workers")
                       + process_count(cfg.servers, "servers"))
        super().__init__(cfg, job_hosts("pserver", cfg))

    def refuses(self, needs, cfg) -> str | None:
        return refusal(cfg.cluster.strategy, needs)

    def launch(self, reporter) -> dict:
        cfg = self.cfg
        if cfg.get("resume"):  # the servers' tables it would load: checked before any starts
            saved = os.path.join(checkpoint.latest(user_path(cfg.resume)), checkpoint.TABLES)
            if os.path.isdir(saved):
                check_manifest(saved, process_count(cfg.servers, "servers"))
        plan = job_plan("pserver", cfg, cfg.workers, cfg.servers,
                        meeting_dir=os.path.join(reporter.run_dir, "gloo"),
                        threads=cfg.cluster.threads,
                        log_dir=os.path.join(reporter.run_dir, "debug"))
        servers = sum(1 for p in plan if p.role == "server")
        workers = len(plan) - servers
        if not servers and not workers:
            raise ConfigError("nothing to start on this host")
        return run_cluster(cfg, reporter, plan, f"{servers} server(s) and {workers} worker(s) "
                           f"({cfg.cluster.strategy})", hosts=self.hosts)
