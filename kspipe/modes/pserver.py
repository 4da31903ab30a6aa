"""Mode ``pserver``: parameter servers (Paddle fleet's the_one_ps, brpc) for any workload.

Started without ``TRAINING_ROLE`` in the environment, the role stage is a cluster job: it
starts ``servers`` server and ``workers`` worker processes (``python -m kspipe.cli.worker``,
each playing its role) and watches them.  In a server or worker process the role is a
:class:`PserverRole`, which distributes the workload's training:

* ``distributed_optimizer(opt)``: the optimiser steps on the worker, then the strategy's
  exchange (:mod:`kspipe.modes.ps.exchange`) sends the change to the servers and takes the
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

import os

from kspipe import checkpoint, hookimpl
from kspipe.checkpoint.resizing import resize_line
from kspipe.checkpoint.tables import check_manifest
from kspipe.cluster import environment
from kspipe.cluster.endpoints import process_count
from kspipe.errors import ConfigError
from kspipe.files import user_path
from kspipe.launchers.hosts import job_hosts
from kspipe.modes.config import ModeConfig
from kspipe.modes.job import ClusterJob
from kspipe.modes.ps.exchange import ExchangingOptimizer, StrategyExchange, check_strategy
from kspipe.modes.ps.tables import FleetTables
from kspipe.modes.role import ParameterSync, Role, check_reduce_mode
from kspipe.process import heartbeat


@hookimpl
def kspipe_config_schemas():
    """The modes' keys of the cluster group (the launchers' are theirs)."""
    return {"cluster": ModeConfig}


@hookimpl
def kspipe_check_config(cfg):
    if cfg.stages.role == "pserver":
        check_strategy(cfg.cluster.strategy, cfg.cluster.k_steps)


@hookimpl
def kspipe_assign_role(cfg, launcher):
    if environment.given("pserver"):
        environment.check("pserver")
        return PserverRole(
            dict(
                strategy=cfg.cluster.strategy,
                k_steps=cfg.cluster.k_steps,
                wait_push=cfg.cluster.wait_push,
                shard_sum=cfg.cluster.shard_sum,
            ),
            resumed_tables(cfg),
            cfg.run_dir,
        )
    return PserverJob(cfg, launcher)


def resumed_tables(cfg) -> str | None:
    """The folder of the servers' tables that a resumed job loads (in its latest
    checkpoint), or None."""
    if not cfg.get("resume"):
        return None
    saved = os.path.join(checkpoint.latest(user_path(cfg.resume)), checkpoint.TABLES)
    return saved if os.path.isdir(saved) else None


def refusal(strategy: str, needs) -> str | None:
    """Why a parameter-server job of ``strategy`` cannot run a workload that ``needs``
    these; None if it can."""
    if "dataset_training" in needs and strategy != "async":
        return (
            f"cluster.strategy={strategy}: training with train_from_dataset runs on "
            f"fleet's own async mode on Paddle 2.6.2 (its sync crashes in "
            f"send_barrier and its geo mode sends no dense parameters)"
        )
    return None


class PserverRole(Role):
    """This process's role in a parameter-server job, read from Paddle's environment."""

    mode = "pserver"

    def __init__(self, cluster: dict | None = None, resumed: str | None = None, run_dir: str = "."):
        super().__init__()
        import paddle
        import paddle.distributed.fleet as fleet

        from kspipe.cluster.meeting import MeetingRoleMaker

        paddle.enable_static()
        self.fleet = fleet
        self.cluster = cluster or {"strategy": "async"}
        self.resumed = resumed  # the folder of the servers' tables the job resumes from
        self.run_dir = run_dir
        fleet.init(MeetingRoleMaker(is_collective=False))

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
        with heartbeat.phase("in the workers' all-gather", waiting=True):
            return list(self.fleet.util.all_gather(value, comm_world="worker"))

    def all_reduce_worker(self, input, output, mode: str = "sum") -> None:
        import numpy as np

        check_reduce_mode(mode)
        with heartbeat.phase("in the workers' all-reduce", waiting=True):
            result = self.fleet.util.all_reduce(np.asarray(input), mode=mode, comm_world="worker")
        np.copyto(np.asarray(output), np.asarray(result).reshape(np.shape(output)))

    def barrier_worker(self) -> None:
        with heartbeat.phase("at the workers' barrier", waiting=True):
            self.fleet.util.barrier("worker")

    # distribution
    def refuses(self, needs, cfg) -> str | None:
        return refusal(self.cluster["strategy"], needs)

    def distributed_optimizer(self, optimizer, strategy=None, feeding: str = "executor"):
        self._gradients_for(optimizer)  # the tables of ``embedding``, fed by exe.run
        if feeding == "dataset":
            tables = (strategy or {}).get("tables")  # fleet's sparse_table_configs, by name
            return self._register(FleetTables(self, optimizer, self.resumed, self.run_dir, tables))
        return ExchangingOptimizer(self, optimizer, dict(self.cluster, **(strategy or {})))

    def parameter_sync(
        self,
        shapes: dict,
        strategy: str | None = None,
        k_steps: int | None = None,
        wait_push: bool | None = None,
        shard_sum: bool | None = None,
    ) -> ParameterSync:
        c = self.cluster
        return self._register(
            StrategyExchange(
                self,
                shapes,
                strategy or c["strategy"],
                k_steps or c.get("k_steps", 1),
                c.get("wait_push", False) if wait_push is None else wait_push,
                c.get("shard_sum", True) if shard_sum is None else shard_sum,
            )
        )

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
        from kspipe.process import stopping

        self.fleet.init_server()
        reporter.say(f"server {self.server_index()} ready")
        stopping.default()  # run_server blocks in C++: let SIGTERM end the process
        stopping.skip_destructors_at_exit()  # a server that gives up ends, not hangs
        heartbeat.serving()  # its launcher watches it from outside from now on
        self.fleet.run_server()


class PserverJob(ClusterJob):
    """Starts this host's servers and workers of the job and watches them."""

    mode = "pserver"

    def __init__(self, cfg, launcher):
        launcher.check(
            cfg, process_count(cfg.workers, "workers") + process_count(cfg.servers, "servers")
        )
        super().__init__(cfg, job_hosts("pserver", cfg), launcher)

    def refuses(self, needs, cfg) -> str | None:
        return refusal(cfg.cluster.strategy, needs)

    def launch(self, reporter) -> dict:
        cfg = self.cfg
        saved = resumed_tables(cfg)
        if saved:  # the servers' tables it would load: checked before any starts
            check_manifest(saved, None)  # whole; split anew if the servers differ
        resized = resize_line(cfg)
        if resized:
            reporter.say(resized)
        plan = self.launcher.plan(
            "pserver", cfg, cfg.workers, cfg.servers, threads=cfg.cluster.threads
        )
        servers = sum(1 for p in plan if p.role == "server")
        workers = len(plan) - servers
        if not servers and not workers:
            raise ConfigError("nothing to start on this host")
        return self.launcher.run(
            cfg,
            reporter,
            plan,
            f"{servers} server(s) and {workers} worker(s) ({cfg.cluster.strategy})",
            hosts=self.hosts,
        )
