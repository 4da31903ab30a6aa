"""Mode ``pserver``: Reptile on Paddle fleet's parameter servers (the_one_ps, brpc).

Stages ``role``, ``compile`` and ``execute``.  Started without ``TRAINING_ROLE`` in the
environment, the role stage is a launcher: it starts ``servers`` server and ``workers``
worker processes (this module again, in each role) and watches them.

How Reptile maps onto the servers: the servers hold theta.  Each worker adapts copies of
theta on its own tasks (the inner Adam loops stay local), then pushes
``g = eps * (theta - mean(phi))`` as the gradient of a one-op "meta program" whose
optimiser on the servers is SGD with step 1, so the servers apply
``theta <- theta + eps * (mean(phi) - theta)``: Reptile's meta step.  Workers split the
meta-iterations between them (worker w runs iterations w, w+W, ...), so a cluster sees
the same tasks as a local run of the same length.

Strategies (``cluster.strategy``), on Paddle 2.6.2:

* ``async``: each worker pushes, waits until its push is sent (``client_flush``), pulls
  theta and goes on.  the_one_ps starts no communicator in async mode, so without that
  explicit pull a worker would never see the servers' theta again.  The flush costs
  ~100 ms on Paddle 2.6.2; ``cluster.wait_push=false`` skips it, and the pull may then
  miss the worker's own last push: faster, but stale meta steps cost accuracy.
* ``sync``: as async, but each worker waits until its push is sent (``client_flush``,
  ~100 ms on Paddle 2.6.2), then a barrier of all workers before the pull, with each push
  scaled by 1/workers: every worker starts an iteration from the same theta, moved by the
  mean of all workers' updates.  (Fleet's own sync mode puts a ``send_barrier`` op in the
  program that needs a communicator the_one_ps never creates: it crashes with SIGSEGV.)
* ``geo``: geo-SGD: each worker applies its meta steps locally and, every
  ``cluster.k_steps`` meta-iterations, pushes the change of theta since its last exchange
  (scaled by 1/workers, as Paddle's geo communicator does) and pulls the merged theta.
  kspipe does the exchange itself: Paddle 2.6.2's geo mode sends no dense parameters from
  ``exe.run`` (its trainer pass adds send ops only for sparse tables in geo mode, and the
  geo communicator is only driven by those), so fleet's own geo would train each worker
  alone.
* ``half_async``: refused; Paddle 2.6.2's fleet has no such mode.
"""

from __future__ import annotations

import os

import numpy as np

from kspipe import hookimpl
from kspipe.builtin.local import compile_programs
from kspipe.cluster import (check_port_free, gloo_env, local_endpoints, run_cluster, this_host,
                            threads_per_worker)
from kspipe.errors import ConfigError
from kspipe.learner import ReptileLearner, train_on_workers
from kspipe.role import FleetCollectives, Role

STRATEGIES = ("sync", "async", "geo")
META_GRAD = "_meta_grad"


# --- role -------------------------------------------------------------------------


@hookimpl
def kspipe_assign_role(cfg):
    check_strategy(cfg)
    if os.environ.get("TRAINING_ROLE"):
        return FleetRole()
    return PserverLauncher(cfg)


def check_strategy(cfg) -> None:
    strategy = cfg.cluster.strategy
    if strategy == "half_async":
        raise ConfigError("cluster.strategy=half_async: Paddle 2.6.2's fleet parameter server "
                          "has no half-async mode (its DistributedStrategy selects only sync, "
                          "async or geo); use cluster.strategy=async")
    if strategy not in STRATEGIES:
        raise ConfigError(f"cluster.strategy={strategy!r} is not one of "
                          f"{', '.join(STRATEGIES + ('half_async',))}")
    if strategy == "geo" and (not isinstance(cfg.cluster.k_steps, int) or cfg.cluster.k_steps < 1):
        raise ConfigError(f"cluster.k_steps={cfg.cluster.k_steps!r} must be at least 1 for geo")


class FleetRole(FleetCollectives, Role):
    """This process's role in a fleet job, read from Paddle's environment variables."""

    def __init__(self):
        import paddle
        import paddle.distributed.fleet as fleet

        paddle.enable_static()
        self.fleet = fleet
        fleet.init(fleet.PaddleCloudRoleMaker(is_collective=False))

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


class PserverLauncher(Role):
    """Starts this host's servers and workers of the job and watches them."""

    is_launcher = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.servers = local_endpoints(cfg.servers, "servers")
        self.workers = local_endpoints(cfg.workers, "workers")
        self.host = this_host(cfg, self.servers + self.workers)

    def worker_num(self):
        return len(self.workers)

    def launch(self, reporter) -> dict:
        cfg = self.cfg
        local = [(role, i, e) for role, eps in (("server", self.servers), ("worker", self.workers))
                 for i, e in enumerate(eps) if e.rpartition(":")[0] == self.host]
        if not local:
            raise ConfigError(f"no server or worker endpoint is on cluster.host={self.host}")
        for _, _, endpoint in local:
            host, _, port = endpoint.rpartition(":")
            check_port_free(host, int(port))
        threads = threads_per_worker(cfg, sum(1 for role, _, _ in local if role == "worker"))
        first_host, _, first_port = self.servers[0].rpartition(":")
        base = dict(os.environ, **paddle_env(self.servers, self.workers, self.host),
                    **gloo_env(reporter.run_dir, self.servers + self.workers,
                               f"{first_host}:{int(first_port) + 1}"))
        plan = []
        for role, index, endpoint in local:
            plan.append((role, index, dict(
                base, TRAINING_ROLE="PSERVER" if role == "server" else "TRAINER",
                PADDLE_PORT=endpoint.rpartition(":")[2],
                PADDLE_TRAINER_ID=str(index if role == "worker" else 0),
                OMP_NUM_THREADS=str(1 if role == "server" else threads))))
        return run_cluster(cfg, reporter, plan, f"{len(self.servers)} server(s) and "
                           f"{len(self.workers)} worker(s) ({cfg.cluster.strategy})")


def paddle_env(servers: list[str], workers: list[str], host: str) -> dict:
    """Paddle's environment contract for a parameter-server job."""
    return {
        "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(servers),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(workers),
        "PADDLE_PSERVER_NUMS": str(len(servers)),
        "PADDLE_TRAINERS_NUM": str(len(workers)),
        "POD_IP": host,
        "GLOG_minloglevel": "2",
    }


# --- compile: the meta program on the servers ---------------------------------------


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    compile_programs(cfg, programs)
    block = programs.train.global_block()
    programs.exchange = ParameterExchange({n: list(block.var(n).shape) for n in programs.params})
    return programs


class ParameterExchange:
    """Moves dense parameters between a worker and the servers.

    A one-op "meta program", ``sum(theta * g)`` over the parameters, is transpiled by fleet
    with SGD of step 1 on the servers: pushing ``g`` makes the servers do ``theta -= g``.
    It lives in a scope of its own, the worker's view of the servers' theta, so the
    model's programs are never transpiled.  Build it in every role (servers take their
    tables from it).
    """

    def __init__(self, shapes: dict):
        import paddle
        import paddle.distributed.fleet as fleet

        self.names = list(shapes)
        self.fleet = fleet
        self.scope = paddle.static.Scope()
        self.runtime = None
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
            terms = []
            for name, shape in shapes.items():
                theta = paddle.static.create_parameter(
                    shape, "float32", name=name,
                    default_initializer=paddle.nn.initializer.Constant(0.0))
                grad = paddle.static.data(name + META_GRAD, shape, "float32")
                terms.append(paddle.sum(paddle.multiply(theta, grad)))
            loss = paddle.add_n(terms)
            strategy = fleet.DistributedStrategy()
            strategy.a_sync = True  # tables that apply every push; kspipe adds the rest
            strategy.a_sync_configs = {"k_steps": 0}
            fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=1.0),
                                        strategy).minimize(loss)
            self.program = loss.block.program
            self.startup = paddle.static.default_startup_program()
        self.exe = paddle.static.Executor(paddle.CPUPlace())

    def connect(self, values: dict) -> dict:
        """Meet the servers with worker 0's ``values``; return the servers' theta."""
        import paddle

        self.exe.run(self.startup, scope=self.scope)
        self.set(values)
        with paddle.static.scope_guard(self.scope):
            self.fleet.init_worker(scopes=[self.scope])
        self.runtime = self.fleet.fleet._runtime_handle
        return self.get()

    def push(self, grads: dict, wait: bool = True) -> None:
        """The servers do ``theta -= grads``.

        With ``wait`` it returns once the push is sent (``client_flush``, which costs about
        100 ms on Paddle 2.6.2: the client polls its queue every 100 ms); without, the push
        leaves in the background and a pull right after may not include it yet.
        """
        feed = {name + META_GRAD: np.asarray(g, np.float32) for name, g in grads.items()}
        self.exe.run(self.program, feed=feed, scope=self.scope)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait until every push has been sent."""
        self.runtime._worker.client_flush()

    def pull(self) -> dict:
        """The servers' theta."""
        pull_all_dense(self.fleet)
        return self.get()

    def get(self) -> dict:
        return {n: np.array(self.scope.find_var(n).get_tensor()) for n in self.names}

    def set(self, values: dict) -> None:
        place = _cpu()
        for name, value in values.items():
            self.scope.var(name).get_tensor().set(np.asarray(value, np.float32), place)

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


# --- execute ------------------------------------------------------------------------


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    fleet = role.fleet
    if role.is_server():
        fleet.init_server()
        reporter.say(f"server {role.server_index()} ready")
        fleet.run_server()
        return {}
    learner = ReptileLearner(cfg, dataset, programs, executor, scope, reporter, role)
    link = ServerLink(learner)
    try:
        return train_on_workers(learner, link.meta_update, after_init=link.connect,
                                after_training=link.finish, before_evaluation=link.pull)
    finally:
        link.close(role.is_first_worker())


class ServerLink:
    """A Reptile worker's side of the strategies, over a :class:`ParameterExchange`."""

    def __init__(self, learner):
        self.learner = learner
        self.cfg, self.role, self.p = learner.cfg, learner.role, learner.p
        self.exchange = self.p.exchange
        self.strategy = self.cfg.cluster.strategy
        self.steps = 0  # geo: meta steps since the last exchange

    def connect(self) -> None:
        """Meet the servers: worker 0's theta becomes theirs, every worker takes it."""
        values = dict(zip(self.p.params, self.learner.values(self.p.params)))
        self._take(self.exchange.connect(values))

    def meta_update(self, eps: float, count: int) -> None:
        if self.strategy == "geo":
            self.learner.local_meta_update(eps, count)
            self.steps += 1
            if self.steps >= self.cfg.cluster.k_steps:
                self.exchange_delta()
            return
        scope = self.learner.scope
        theta = self.learner.values([n + "@THETA" for n in self.p.params])
        acc = self.learner.values([n + "@ACC" for n in self.p.params])
        scale = eps / (self.role.worker_num() if self.strategy == "sync" else 1)
        # Without waiting for its push (cluster.wait_push=false) the next pull may miss
        # it: ~100 ms faster per iteration, but stale meta steps (see docs/distributed.md)
        self.exchange.push({n: scale * (t - a / count) for n, t, a in zip(self.p.params, theta, acc)},
                           wait=self.strategy == "sync" or self.cfg.cluster.wait_push)
        for name, a in zip(self.p.params, acc):
            scope.find_var(name + "@ACC").get_tensor().set(np.zeros_like(a), _cpu())
        if self.strategy == "sync":
            self.role.barrier_worker()
        self.pull()

    def exchange_delta(self) -> None:
        """geo: push the change since the last exchange (divided among workers), pull."""
        theta = self.learner.values([n + "@THETA" for n in self.p.params])
        last = self.exchange.get()
        workers = self.role.worker_num()
        self.exchange.push({n: (last[n] - t) / workers for n, t in zip(self.p.params, theta)})
        self.pull()
        self.steps = 0

    def finish(self) -> None:
        """Send what is still local, then wait until every worker has."""
        if self.strategy == "geo" and self.steps:
            self.exchange_delta()
        self.exchange.flush()
        self.role.barrier_worker()

    def pull(self) -> None:
        self._take(self.exchange.pull())

    def _take(self, theta: dict) -> None:
        """theta (and the working weights) <- the servers' view."""
        scope = self.learner.scope
        for name, value in theta.items():
            scope.find_var(name).get_tensor().set(value, _cpu())
        self.learner.run(self.p.save_theta)

    def close(self, first: bool) -> None:
        self.exchange.close(first)


def _cpu():
    import paddle

    return paddle.CPUPlace()
