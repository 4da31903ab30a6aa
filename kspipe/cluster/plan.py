"""A job's plan: the processes a mode needs, with their roles, endpoints and environment.

:func:`launch_plan` is the one builder of a job's processes (used by ``mode=pserver``,
``mode=collective``, isolated local runs, ``kspipe-launch`` and every process launcher):
each gets Paddle's environment contract (``TRAINING_ROLE``, ``PADDLE_TRAINER_ID``,
``PADDLE_PSERVERS_IP_PORT_LIST``, ...), so a scheduler that sets those variables can start
the same roles without kspipe.  Who starts them is a launcher's business
(:mod:`kspipe.launchers.processes`, :mod:`kspipe.launchers.watcher`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kspipe.cluster import environment, secret
from kspipe.cluster.endpoints import (
    check_port_free,
    endpoints,
    free_ports,
    parse_endpoints,
    this_host,
)
from kspipe.errors import ConfigError
from kspipe.files import WORKDIR_ENV, workdir

LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass
class Planned:
    """One process of a job: its role, index, endpoint and environment."""

    role: str  # "server" or "worker"
    index: int
    endpoint: str
    env: dict


def launch_plan(
    kind: str,
    workers,
    servers=None,
    host: str | None = None,
    threads: int | None = None,
    devices: list[int] | None = None,
    every_host: bool = False,
    meeting_port: int | None = None,
) -> list[Planned]:
    """The processes this host starts for a ``kind`` ("pserver", "collective" or "local":
    one process of its own) job.

    ``workers`` and ``servers`` are counts (free ports on 127.0.0.1 are taken) or
    ``host:port`` lists (a job across hosts; ``host`` names this one when they name
    several).  Each process gets Paddle's environment contract (``TRAINING_ROLE``,
    ``PADDLE_TRAINER_ID``, ``PADDLE_TRAINER_ENDPOINTS`` ...), so a scheduler that sets the
    same variables can start the roles without kspipe, and ``OMP_NUM_THREADS`` so this
    host's workers share its cores (``threads`` each, default cores / local workers), and
    :data:`kspipe.cluster.environment.SHARED_CORES_ENV`, and the job's secret
    (:data:`kspipe.cluster.secret.SECRET_ENV`, this process's, else a new one).
    The ports of this host's processes are checked free.  With ``every_host``, the plan
    holds every host's processes (a scheduler starts each on its host).  ``meeting_port``
    is where gloo's meeting point listens on the first endpoint's host, when the caller
    has drawn one (else :func:`fleet_gloo_env` and :func:`gloo_endpoint` choose).
    """
    if kind == "local":
        endpoint = worker_list[0] if (worker_list := parse_endpoints(workers, "workers")) else ""
        return [Planned("worker", 0, endpoint, dict(os.environ, **{WORKDIR_ENV: workdir()}))]
    worker_eps = endpoints(workers, "workers")
    server_eps = endpoints(servers, "servers") if kind == "pserver" else []
    everyone = server_eps + worker_eps
    here = this_host(host, everyone) if not every_host else None
    local = [
        (role, i, e)
        for role, eps in (("server", server_eps), ("worker", worker_eps))
        for i, e in enumerate(eps)
        if every_host or e.rpartition(":")[0] == here
    ]
    if not local:
        raise ConfigError(f"no server or worker endpoint is on cluster.host={here}")
    for _, _, endpoint in local:
        address, _, port = endpoint.rpartition(":")
        if address in LOCAL_HOSTS or not every_host:
            check_port_free(address, int(port))
    local_workers = sum(1 for role, _, _ in local if role == "worker")
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, local_workers))
    if kind == "pserver":
        meeting = meeting_point(everyone, workers, every_host, meeting_port, kind)
    else:
        meeting = meeting_point(worker_eps, workers, every_host, meeting_port, kind)
    secret.ensure()  # the job's secret (kspipe.cluster.secret): every process inherits it
    base = dict(
        os.environ,
        GLOG_minloglevel="2",
        **{WORKDIR_ENV: workdir()},
        **environment.job_env(kind, worker_eps, server_eps, meeting),
    )
    environment.share_cores(base)
    plan = []
    for role, index, endpoint in local:
        device = devices[index % len(devices)] if devices and role == "worker" else None
        own = 1 if role == "server" else threads
        env = dict(
            base,
            OMP_NUM_THREADS=str(own),
            KSPIPE_THREADS=str(own),
            **environment.process_env(kind, role, index, endpoint, device),
        )
        plan.append(Planned(role, index, endpoint, env))
    return plan


def meeting_point(
    eps: list[str], workers, every_host: bool, meeting_port: int | None, kind: str
) -> str:
    """Where the job's processes meet to set up gloo, on the first endpoint's host (server
    0's for a parameter-server job, worker 0's for a collective one): ``meeting_port`` when
    the caller drew one; a free port when the whole job is on this host; else beside the
    first endpoint (:func:`kspipe.cluster.environment.beside`)."""
    host = eps[0].rpartition(":")[0]
    if meeting_port is not None:
        return f"{host}:{meeting_port}"
    if kind == "pserver":
        here = not every_host and all(e.rpartition(":")[0] in LOCAL_HOSTS for e in eps)
    else:
        here = parse_endpoints(workers, "workers") is None
    return f"{host}:{free_ports(1, host)[0]}" if here else environment.beside(eps[0])
