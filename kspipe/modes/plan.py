"""A job's plan: the processes a mode needs, with their roles, endpoints and environment.

:func:`launch_plan` is the one builder of a job's processes (used by ``mode=pserver``,
``mode=collective``, isolated local runs, ``kspipe-launch`` and every process launcher):
each gets Paddle's environment contract (``TRAINING_ROLE``, ``PADDLE_TRAINER_ID``,
``PADDLE_PSERVERS_IP_PORT_LIST``, ...), so a scheduler that sets those variables can start
the same roles without kspipe.  Who starts them is a launcher's business
(:mod:`kspipe.modes.launchers`, :mod:`kspipe.modes.launch`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kspipe.endpoints import check_port_free, endpoints, free_ports, parse_endpoints, this_host
from kspipe.errors import ConfigError
from kspipe.files import WORKDIR_ENV, workdir

LOCAL_HOSTS = ("127.0.0.1", "localhost")

#: What every process of a job gets unless the user set it.  A job's processes share their
#: host's cores, and OpenMP's threads (Paddle's Intel runtime) wait ``KMP_BLOCKTIME`` ms
#: for more work after each parallel region: its default, 200, has them spin, yielding,
#: between every step, taking the CPU from the servers (one worker with 2 threads beside a
#: server on 2 cores: ~400,000 yields a second; the classifier plugin's async rate, median
#: of 6 runs, 14,384 samples/s against 19,710 with 0: BENCHMARKS.md).
SHARED_CORES_ENV = {"KMP_BLOCKTIME": "0"}


def share_cores(environ) -> None:
    """Set :data:`SHARED_CORES_ENV` in ``environ`` where the user has not."""
    for name, value in SHARED_CORES_ENV.items():
        environ.setdefault(name, value)


@dataclass
class Planned:
    """One process of a job: its role, index, endpoint and environment."""

    role: str  # "server" or "worker"
    index: int
    endpoint: str
    env: dict


def launch_plan(kind: str, workers, servers=None, host: str | None = None,
                threads: int | None = None,
                devices: list[int] | None = None,
                every_host: bool = False, meeting_port: int | None = None) -> list[Planned]:
    """The processes this host starts for a ``kind`` ("pserver", "collective" or "local":
    one process of its own) job.

    ``workers`` and ``servers`` are counts (free ports on 127.0.0.1 are taken) or
    ``host:port`` lists (a job across hosts; ``host`` names this one when they name
    several).  Each process gets Paddle's environment contract (``TRAINING_ROLE``,
    ``PADDLE_TRAINER_ID``, ``PADDLE_TRAINER_ENDPOINTS`` ...), so a scheduler that sets the
    same variables can start the roles without kspipe, and ``OMP_NUM_THREADS`` so this
    host's workers share its cores (``threads`` each, default cores / local workers), and
    :data:`SHARED_CORES_ENV`.
    The ports of this host's processes are checked free.  With ``every_host``, the plan
    holds every host's processes (a scheduler starts each on its host).  ``meeting_port``
    is where gloo's meeting point listens on the first endpoint's host, when the caller
    has drawn one (else :func:`fleet_gloo_env` and :func:`gloo_endpoint` choose).
    """
    if kind == "local":
        return [Planned("worker", 0, "", dict(os.environ, **{WORKDIR_ENV: workdir()}))]
    worker_eps = endpoints(workers, "workers")
    server_eps = endpoints(servers, "servers") if kind == "pserver" else []
    everyone = server_eps + worker_eps
    here = this_host(host, everyone) if not every_host else None
    local = [(role, i, e) for role, eps in (("server", server_eps), ("worker", worker_eps))
             for i, e in enumerate(eps) if every_host or e.rpartition(":")[0] == here]
    if not local:
        raise ConfigError(f"no server or worker endpoint is on cluster.host={here}")
    for _, _, endpoint in local:
        address, _, port = endpoint.rpartition(":")
        if address in LOCAL_HOSTS or not every_host:
            check_port_free(address, int(port))
    local_workers = sum(1 for role, _, _ in local if role == "worker")
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, local_workers))
    base = dict(os.environ, GLOG_minloglevel="2", **{WORKDIR_ENV: workdir()},
                PADDLE_TRAINER_ENDPOINTS=",".join(worker_eps),
                PADDLE_TRAINERS_NUM=str(len(worker_eps)))
    share_cores(base)
    if kind == "pserver":
        base.update(PADDLE_PSERVERS_IP_PORT_LIST=",".join(server_eps),
                    PADDLE_PSERVER_NUMS=str(len(server_eps)),
                    **fleet_gloo_env(everyone, every_host, meeting_port))
    else:
        base[GLOO_ENDPOINT_ENV] = gloo_endpoint(workers, worker_eps, meeting_port)
    plan = []
    for role, index, endpoint in local:
        env = dict(base, PADDLE_PORT=endpoint.rpartition(":")[2],
                   OMP_NUM_THREADS=str(1 if role == "server" else threads),
                   KSPIPE_THREADS=str(1 if role == "server" else threads))
        if kind == "pserver":
            env.update(TRAINING_ROLE="PSERVER" if role == "server" else "TRAINER",
                       PADDLE_TRAINER_ID=str(index if role == "worker" else 0),
                       POD_IP=endpoint.rpartition(":")[0])
        else:
            env.update(PADDLE_TRAINER_ID=str(index), PADDLE_CURRENT_ENDPOINT=endpoint)
            if devices:
                env["FLAGS_selected_gpus"] = str(devices[index % len(devices)])
        plan.append(Planned(role, index, endpoint, env))
    return plan


#: Where a collective job's workers meet to set up gloo (worker 0 serves it).
GLOO_ENDPOINT_ENV = "KSPIPE_GLOO_ENDPOINT"


def gloo_endpoint(workers, worker_eps: list[str], meeting_port: int | None = None) -> str:
    """``meeting_port`` or a free port beside worker 0 on one host; across hosts, worker
    0's port + 1."""
    host, _, port = worker_eps[0].rpartition(":")
    if meeting_port is not None:
        return f"{host}:{meeting_port}"
    if parse_endpoints(workers, "workers") is None:
        return f"{host}:{free_ports(1, host)[0]}"
    return f"{host}:{int(port) + 1}"


def fleet_gloo_env(endpoints: list[str], every_host: bool = False,
                   meeting_port: int | None = None) -> dict:
    """Where a parameter-server job's processes meet for fleet's gloo: server 0 serves the
    meeting point (:mod:`kspipe.modes.meeting`) on ``meeting_port``, else on a free port of
    its host when the whole job is on this one, else on its port + 1."""
    host, _, port = endpoints[0].rpartition(":")
    if meeting_port is not None:
        meeting = meeting_port
    elif not every_host and all(e.rpartition(":")[0] in LOCAL_HOSTS for e in endpoints):
        meeting = free_ports(1, host)[0]
    else:
        meeting = int(port) + 1
    return {"PADDLE_WITH_GLOO": "1", "PADDLE_GLOO_RENDEZVOUS": "3",
            "PADDLE_GLOO_HTTP_ENDPOINT": f"{host}:{meeting}"}
