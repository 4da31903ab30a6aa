"""Paddle's environment contract: what a process of a job learns of its place from its
environment, written here for each planned process and read back here by its role.

Two contracts, by the role a process plays:

* a parameter-server job's server or worker (``TRAINING_ROLE`` = ``PSERVER`` or
  ``TRAINER``, ``PADDLE_PSERVERS_IP_PORT_LIST``, ``PADDLE_TRAINER_ENDPOINTS``,
  ``PADDLE_TRAINER_ID``, ``POD_IP``, ``PADDLE_PORT``, fleet's gloo meeting point);
* a collective job's worker (``PADDLE_TRAINER_ID``, ``PADDLE_TRAINER_ENDPOINTS``,
  ``PADDLE_CURRENT_ENDPOINT``, kspipe's gloo meeting point :data:`GLOO_ENDPOINT_ENV`);

and for both, the job's secret (``KSPIPE_JOB_SECRET``: :mod:`kspipe.cluster.secret`).

kspipe's launchers write it (:func:`job_env`, :func:`process_env`); Paddle's launcher,
a ``PaddleJob``'s pods and Slurm steps set the same variables, so a role started by any of
them reads its place the same way (:func:`given`, :func:`check`, :func:`collective_place`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kspipe.cluster.secret import SECRET_ENV

#: What every process of a job gets unless the user set it.  A job's processes share their
#: host's cores, and OpenMP's threads (Paddle's Intel runtime) wait ``KMP_BLOCKTIME`` ms
#: for more work after each parallel region: its default, 200, has them spin, yielding,
#: between every step, taking the CPU from the servers (one worker with 2 threads beside a
#: server on 2 cores: ~400,000 yields a second; the classifier plugin's async rate, median
#: of 6 runs, 14,384 samples/s against 19,710 with 0: BENCHMARKS.md).
SHARED_CORES_ENV = {"KMP_BLOCKTIME": "0"}

#: Where a collective job's workers meet to set up gloo (worker 0 serves it).
GLOO_ENDPOINT_ENV = "KSPIPE_GLOO_ENDPOINT"

#: The contracts' variables a role started from its environment needs, by role.
NEEDED = {
    "PSERVER": ("PADDLE_PSERVERS_IP_PORT_LIST", "PADDLE_TRAINERS_NUM", "POD_IP", "PADDLE_PORT"),
    "TRAINER": (
        "PADDLE_PSERVERS_IP_PORT_LIST",
        "PADDLE_TRAINER_ENDPOINTS",
        "PADDLE_TRAINERS_NUM",
        "PADDLE_TRAINER_ID",
    ),
    "collective": ("PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINER_ID"),
}
#: How a parameter-server job's processes meet (fleet's gloo): where, by rendezvous kind.
GLOO_MEETING = {"2": "PADDLE_GLOO_FS_PATH", "3": "PADDLE_GLOO_HTTP_ENDPOINT"}


def share_cores(environ) -> None:
    """Set :data:`SHARED_CORES_ENV` in ``environ`` where the user has not."""
    for name, value in SHARED_CORES_ENV.items():
        environ.setdefault(name, value)


def beside(endpoint: str) -> str:
    """The meeting point of a job across hosts: the first process's port + 1 on its host
    (every host computes the same one without talking)."""
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + 1}"


def job_env(kind: str, worker_eps: list[str], server_eps: list[str], meeting: str) -> dict:
    """What every process of a ``kind`` ("pserver" or "collective") job is told: the job's
    endpoints and where its processes meet (``meeting``, ``host:port``)."""
    env = {
        "PADDLE_TRAINER_ENDPOINTS": ",".join(worker_eps),
        "PADDLE_TRAINERS_NUM": str(len(worker_eps)),
    }
    if kind == "pserver":
        env.update(
            PADDLE_PSERVERS_IP_PORT_LIST=",".join(server_eps),
            PADDLE_PSERVER_NUMS=str(len(server_eps)),
            PADDLE_WITH_GLOO="1",
            PADDLE_GLOO_RENDEZVOUS="3",
            PADDLE_GLOO_HTTP_ENDPOINT=meeting,
        )
    else:
        env[GLOO_ENDPOINT_ENV] = meeting
    return env


def process_env(kind: str, role: str, index: int, endpoint: str, device: int | None = None) -> dict:
    """What one process (``role`` "server" or "worker", its ``index`` and ``endpoint``) of a
    ``kind`` job is told of its own place."""
    env = {"PADDLE_PORT": endpoint.rpartition(":")[2]}
    if kind == "pserver":
        env.update(
            TRAINING_ROLE="PSERVER" if role == "server" else "TRAINER",
            PADDLE_TRAINER_ID=str(index if role == "worker" else 0),
            POD_IP=endpoint.rpartition(":")[0],
        )
    else:
        env.update(PADDLE_TRAINER_ID=str(index), PADDLE_CURRENT_ENDPOINT=endpoint)
        if device is not None:
            env["FLAGS_selected_gpus"] = str(device)
    return env


def given(kind: str | None, env=os.environ) -> bool:
    """Whether this process was given its place in a ``kind`` job by its environment: a
    ``TRAINING_ROLE`` for a parameter-server job; for a collective one ``PADDLE_TRAINER_ID``
    with ``PADDLE_TRAINER_ENDPOINTS`` (a collective PaddleJob's pods have a
    ``TRAINING_ROLE=TRAINER`` as well)."""
    if kind == "pserver":
        return bool(env.get("TRAINING_ROLE"))
    if kind == "collective":
        return env.get("PADDLE_TRAINER_ID") is not None and bool(
            env.get("PADDLE_TRAINER_ENDPOINTS")
        )
    return False


def any_given(env=os.environ) -> bool:
    """Whether this process was given a place in a job of either contract."""
    return given("pserver", env) or given("collective", env)


def check(kind: str, env=os.environ) -> None:
    """Refuse, in one line naming it, an environment that lacks what this process's role
    needs (a :class:`~kspipe.errors.ConfigError`, before anything starts)."""
    from kspipe.errors import ConfigError

    role = env.get("TRAINING_ROLE") if kind == "pserver" else "collective"
    if role not in NEEDED:
        raise ConfigError(
            f"TRAINING_ROLE={role}: a parameter-server job's process is PSERVER or TRAINER"
        )
    where = "the environment (Paddle's launcher, a PaddleJob or kspipe's own sets it)"
    missing = [name for name in NEEDED[role] if not env.get(name)]
    if kind == "pserver":
        meeting = GLOO_MEETING.get(env.get("PADDLE_GLOO_RENDEZVOUS", ""))
        if env.get("PADDLE_WITH_GLOO", "0") == "0" or not meeting:
            raise ConfigError(
                f"a parameter-server job's processes meet through fleet's gloo: "
                f"set PADDLE_WITH_GLOO=1 and PADDLE_GLOO_RENDEZVOUS=3 with "
                f"PADDLE_GLOO_HTTP_ENDPOINT (or 2 with PADDLE_GLOO_FS_PATH) in "
                f"{where}; a PaddleJob sets them with withGloo: 1"
            )
        missing += [meeting] if not env.get(meeting) else []
    missing += [SECRET_ENV] if not env.get(SECRET_ENV) else []
    if missing:
        raise ConfigError(
            f"{role if kind == 'pserver' else 'a collective worker'}: "
            f"{', '.join(missing)} not set in {where}"
        )
    trainers = env.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")
    if "PADDLE_TRAINER_ID" in NEEDED[role]:
        index = env["PADDLE_TRAINER_ID"]
        if not index.isdigit() or int(index) >= len(trainers):
            raise ConfigError(
                f"PADDLE_TRAINER_ID={index} is not one of the "
                f"{len(trainers)} workers of PADDLE_TRAINER_ENDPOINTS"
            )


@dataclass(frozen=True)
class CollectivePlace:
    """A collective worker's place, as its environment gives it."""

    rank: int
    endpoints: list
    nranks: int
    device: str | None  # FLAGS_selected_gpus
    meeting: str  # where the workers meet to set up gloo


def collective_place(env=os.environ) -> CollectivePlace:
    """Read a collective worker's place (the launcher's meeting point, else beside worker 0)."""
    endpoints = env.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")
    return CollectivePlace(
        rank=int(env["PADDLE_TRAINER_ID"]),
        endpoints=endpoints,
        nranks=int(env.get("PADDLE_TRAINERS_NUM", len(endpoints))),
        device=env.get("FLAGS_selected_gpus"),
        meeting=env.get(GLOO_ENDPOINT_ENV) or beside(endpoints[0]),
    )
