"""``cluster.launcher=paddlejob``: the job as a Kubernetes ``PaddleJob`` (paddle-operator).

kspipe does not talk to Kubernetes: it writes the manifest, ``<run>/paddlejob.yaml``, and
says how to apply it.  The operator starts one pod per server (``spec.ps``) and per worker
(``spec.worker``) and injects Paddle's environment contract into each (``POD_IP``,
``PADDLE_TRAINER_ID``, ``TRAINING_ROLE``, and from the job's ConfigMap
``PADDLE_PSERVERS_IP_PORT_LIST``, ``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_PORT``, gloo's
``PADDLE_WITH_GLOO``...; ``withGloo: 1`` asks for those).  Every pod runs the same
``kspipe <overrides>`` as the command that wrote the manifest, with ``cluster.job_id`` the
job's name, so its processes share one run folder, ``outputs/job-<name>`` (kspipe/job.py):
give the pods a shared volume as their working folder (or ``run_dir=`` on one) and a
``tracking.uri`` they all reach: a job whose record or run folder would stay in each pod's
own working folder, deleted with the pods, is said in one line (:func:`lost_results`).  A
pod that starts again under the same manifest (the manifest applied again, or a pod
restarted by a policy of the user's) records into the job's MLflow run
(:mod:`kspipe.observers.mlflow.earlier_runs`).

The pods share the job's secret (:mod:`kspipe.cluster.secret`) through a Kubernetes
Secret, ``<name>-kspipe``, that the manifest's containers read as ``KSPIPE_JOB_SECRET``;
kspipe writes no secret to disk: the line that names the manifest gives the one command
that makes it (:func:`secret_command`).

Restarts: paddle-operator's ``PaddleJob`` has no restart count, and it fails the job once
any pod has failed; a pod that Kubernetes restarted alone (``restartPolicy: OnFailure``)
would rejoin peers that went on without it, from the start of its own part.  So every pod
template says ``restartPolicy: Never``, and ``cluster.max_restarts`` above 0 is refused
in one line: the job restarts by being applied again with ``resume=<its run folder>``.
"""

from __future__ import annotations

import os
import secrets
import time

from kspipe import hookimpl
from kspipe.cluster.secret import SECRET_ENV
from kspipe.errors import ConfigError
from kspipe.job import JOB_TOKEN_ENV
from kspipe.launchers.processes import ProcessLauncher
from kspipe.reporting import say

API_VERSION = "batch.paddlepaddle.org/v1"
#: The key of the job's Kubernetes Secret that holds its secret.
SECRET_KEY = "secret"


class PaddleJobLauncher(ProcessLauncher):
    """``cluster.launcher=paddlejob``: the ``kspipe`` command writes the manifest."""

    name = "paddlejob"

    def hands_off(self, cfg) -> bool:
        return cfg.mode in ("pserver", "collective")

    def hand_off(self, cfg, overrides: list[str]) -> str:
        if int(cfg.cluster.get("max_restarts") or 0):
            raise ConfigError(
                f"cluster.max_restarts={cfg.cluster.max_restarts}: a PaddleJob cannot "
                f"restart its pods together from a checkpoint (paddle-operator fails the "
                f"job when a pod fails); apply it again with resume=<its run folder>"
            )
        path, name = write(cfg, overrides, cfg.run_dir)
        lost = lost_results(cfg, overrides, name)
        if lost:
            say(f"warning: {lost}")
        return (
            f"wrote the PaddleJob {path}; make its secret with {secret_command(name)}, "
            f"then start it with kubectl apply -f {path}"
        )

    def check(self, cfg, processes: int) -> None:
        raise ConfigError(
            "cluster.launcher=paddlejob: the kspipe command writes the job's "
            "PaddleJob manifest; Kubernetes starts its processes"
        )


@hookimpl
def kspipe_process_launchers():
    return [PaddleJobLauncher()]


def pod_command(overrides: list[str], name: str) -> list[str]:
    """What every pod runs: the overrides given, with the job's id and no launcher."""
    kept = [
        o
        for o in overrides
        if o.lstrip("+~").partition("=")[0]
        not in ("cluster.launcher", "cluster.job_id", "cluster.image")
    ]
    return ["kspipe", *kept, f"cluster.job_id={name}"]


def manifest(cfg, overrides: list[str], name: str) -> dict:
    """The ``PaddleJob`` of this job: ``spec.ps`` (pserver) and ``spec.worker`` replicas,
    gloo, the image, and the pods' command.  Every pod gets the manifest's token
    (:data:`kspipe.job.JOB_TOKEN_ENV`, drawn here): a pod that Kubernetes restarts goes on
    with the job's MLflow run, and a new manifest of the same job name records a new one."""
    from kspipe.cluster.endpoints import process_count

    if not cfg.cluster.get("image"):
        raise ConfigError(
            "cluster.launcher=paddlejob: cluster.image names the container image "
            "the pods run (one with kspipe and its plugins installed)"
        )

    token = secrets.token_hex(8)

    def replicas(count: int) -> dict:
        container = {
            "name": "kspipe",
            "image": str(cfg.cluster.image),
            "command": pod_command(overrides, name),
            "env": [
                {"name": JOB_TOKEN_ENV, "value": token},
                {
                    "name": SECRET_ENV,
                    "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": SECRET_KEY}},
                },
            ],
        }
        # never one pod alone: the job fails, and is applied again with resume=
        pod = {"containers": [container], "restartPolicy": "Never"}
        return {"replicas": count, "template": {"spec": pod}}

    spec = {"withGloo": 1, "intranet": "PodIP", "cleanPodPolicy": "OnCompletion"}
    if cfg.mode == "pserver":
        spec["ps"] = replicas(process_count(cfg.servers, "servers"))
    spec["worker"] = replicas(process_count(cfg.workers, "workers"))
    return {
        "apiVersion": API_VERSION,
        "kind": "PaddleJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def lost_results(cfg, overrides: list[str], name: str) -> str | None:
    """Where the job's results would be lost, if its pods keep them in their own working
    folders (a relative path: each pod has its own, which ``cleanPodPolicy: OnCompletion``
    deletes with the pod): its MLflow store (``tracking.uri``, a SQLite file by default),
    its run folder (``run_dir=`` as the pods are given it, else ``outputs/job-<name>``).
    An absolute path is taken for a volume the pods share; a tracking server for one
    every pod reaches.  None if nothing is lost."""
    lost, hints = [], []
    uri = str(cfg.tracking.get("uri") or "sqlite:///mlflow.db")
    if cfg.tracking.enabled and in_pod(uri):
        lost.append(f"its own SQLite store (tracking.uri={uri})")
        hints.append("tracking.uri=<a tracking server>")
    given = [o.partition("=")[2] for o in overrides if o.lstrip("+~").startswith("run_dir=")]
    run_dir = given[-1] if given else f"outputs/job-{name}"
    if not os.path.isabs(run_dir):
        lost.append(f"its own run folder ({run_dir})")
        hints.append("run_dir=<a folder on a volume every pod mounts>")
    if not lost:
        return None
    return (
        f"the PaddleJob's results would be lost with its pods: each keeps "
        f"{' and '.join(lost)} in its working folder, deleted with the pod "
        f"(cleanPodPolicy: OnCompletion); give {' and '.join(hints)}"
    )


def in_pod(uri: str) -> bool:
    """Whether an MLflow store at ``uri`` would be a file in a pod's working folder."""
    scheme, colon, rest = uri.partition(":")
    if not colon:
        return not os.path.isabs(uri)
    if scheme in ("sqlite", "file"):
        path = rest.removeprefix("///") if scheme == "sqlite" else rest.removeprefix("//")
        return not os.path.isabs(path)
    return False  # a tracking server, or a database every pod reaches


def secret_name(name: str) -> str:
    """The Kubernetes Secret that holds the job ``name``'s secret."""
    return f"{name}-kspipe"


def secret_command(name: str) -> str:
    """The command that makes the job ``name``'s Secret (a new random value)."""
    return (
        f"kubectl create secret generic {secret_name(name)} "
        f"--from-literal={SECRET_KEY}=$(openssl rand -hex 32)"
    )


def write(cfg, overrides: list[str], run_dir: str) -> tuple[str, str]:
    """Write ``<run_dir>/paddlejob.yaml``; its path and the job's name."""
    import yaml

    name = cfg.cluster.get("job_id") or time.strftime("kspipe-%Y%m%d-%H%M%S")
    job = manifest(cfg, overrides, str(name))
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "paddlejob.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path, str(name)
