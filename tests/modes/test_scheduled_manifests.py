"""Roles a scheduler starts, as Kubernetes does: an environment missing what a role needs is
one line, a PaddleJob manifest runs as one job from the operator's environment (the same
model as kspipe's own launcher, bit for bit), and every role shares its host's cores
however it was started.  The roles Paddle's launcher or hand-started pods run are
tests/modes/test_scheduled_roles.py's.
"""

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kspipe.job import JOB_TOKEN_ENV
from kspipe.testing import run_statuses
from tests.kit import latest_weights, scheduled_overrides

#: what kspipe's launcher gives each process (one math thread each on 2 cores), so that
#: the float sums are the same
THREADS = {"OMP_NUM_THREADS": "1", "KSPIPE_THREADS": "1"}
#: the job's secret, which whoever starts the roles hands to each (kspipe.cluster.secret)
SECRET = {"KSPIPE_JOB_SECRET": "5e" * 32}


@pytest.mark.parametrize(
    "environment, message",
    [
        (
            {
                "TRAINING_ROLE": "TRAINER",
                "PADDLE_TRAINER_ID": "0",
                "PADDLE_TRAINERS_NUM": "1",
                "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7000",
                "PADDLE_WITH_GLOO": "1",
                "PADDLE_GLOO_RENDEZVOUS": "3",
                "PADDLE_GLOO_HTTP_ENDPOINT": "127.0.0.1:7001",
            },
            "TRAINER: PADDLE_PSERVERS_IP_PORT_LIST not set in the environment",
        ),
        (
            {
                "TRAINING_ROLE": "TRAINER",
                "PADDLE_TRAINER_ID": "0",
                "PADDLE_TRAINERS_NUM": "1",
                "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:7002",
                "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7000",
                "PADDLE_WITH_GLOO": "1",
                "PADDLE_GLOO_RENDEZVOUS": "3",
                "PADDLE_GLOO_HTTP_ENDPOINT": "127.0.0.1:7001",
                "KSPIPE_JOB_SECRET": "",
            },
            "TRAINER: KSPIPE_JOB_SECRET not set in the environment",
        ),
        (
            {
                "TRAINING_ROLE": "TRAINER",
                "PADDLE_TRAINER_ID": "2",
                "PADDLE_TRAINERS_NUM": "2",
                "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:7002",
                "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7000,127.0.0.1:7003",
                "PADDLE_WITH_GLOO": "1",
                "PADDLE_GLOO_RENDEZVOUS": "3",
                "PADDLE_GLOO_HTTP_ENDPOINT": "127.0.0.1:7001",
            },
            "PADDLE_TRAINER_ID=2 is not one of the 2 workers of PADDLE_TRAINER_ENDPOINTS",
        ),
        (
            {
                "TRAINING_ROLE": "PSERVER",
                "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:7002",
                "PADDLE_TRAINERS_NUM": "1",
                "POD_IP": "127.0.0.1",
                "PADDLE_PORT": "7002",
            },
            "a parameter-server job's processes meet through fleet's gloo",
        ),
        (
            {"TRAINING_ROLE": "HETER_TRAINER"},
            "TRAINING_ROLE=HETER_TRAINER: a parameter-server job's process is PSERVER or TRAINER",
        ),
    ],
)
def test_an_environment_missing_what_a_role_needs_is_one_line(
    tmp_path, tiny_data, environment, message
):
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PADDLE_", "TRAINING_ROLE", "POD_IP"))
    }
    result = subprocess.run(
        [sys.executable, "-m", "kspipe.cli.command", *scheduled_overrides(tmp_path, tiny_data)],
        cwd=tmp_path,
        env={**clean, **SECRET, **environment},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("kspipe: error: ") and message in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert run_statuses(tmp_path / "mlflow.db") == []


# --- Kubernetes: a PaddleJob ---------------------------------------------------------

#: paddle-operator's constants (controllers/paddlejob_controller.go): every pod's port, and
#: how many it may use (gloo's HTTP store is on the first server's port + 18)
OPERATOR_PORT, OPERATOR_PORTS = 36000, 20


def operator_environments(job: dict, secrets: dict) -> list[tuple[str, dict]]:
    """Each pod of ``job`` (a PaddleJob) with the environment paddle-operator gives it
    (its ConfigMap, POD_IP, PADDLE_TRAINER_ID, TRAINING_ROLE, and the container's own
    variables, a Secret's from ``secrets``: {(secret, key): value}), pod IPs on loopback."""
    spec = job["spec"]
    kinds = [("ps", "PSERVER"), ("worker", "TRAINER")]
    pods, address = [], 2
    for kind, role in kinds:
        for index in range(spec[kind]["replicas"] if kind in spec else 0):
            pods.append((kind, index, role, f"127.0.0.{address}"))
            address += 1
    servers = [f"{ip}:{OPERATOR_PORT}" for kind, _, _, ip in pods if kind == "ps"]
    workers = [f"{ip}:{OPERATOR_PORT}" for kind, _, _, ip in pods if kind == "worker"]
    config_map = {
        "TRAINER_PORTS_NUM": str(OPERATOR_PORTS),
        "PADDLE_PORT": str(OPERATOR_PORT),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(workers),
        "PADDLE_TRAINERS": ",".join(w.rpartition(":")[0] for w in workers),
        "PADDLE_TRAINERS_NUM": str(len(workers)),
    }
    if servers:
        config_map["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(servers)
        if spec.get("withGloo", 0) > 0:
            host = servers[0].rpartition(":")[0]
            config_map.update(
                PADDLE_WITH_GLOO=str(spec["withGloo"]),
                PADDLE_GLOO_RENDEZVOUS="3",
                PADDLE_GLOO_HTTP_ENDPOINT=f"{host}:{OPERATOR_PORT + OPERATOR_PORTS - 2}",
            )
    out = []
    for kind, index, role, ip in pods:
        (container,) = spec[kind]["template"]["spec"]["containers"]
        env = {
            **config_map,
            "POD_IP": ip,
            "PADDLE_TRAINER_ID": str(index),
            "TRAINING_ROLE": role,
            "PADDLE_TRAINING_ROLE": role,
            **{e["name"]: value_of(e, secrets) for e in container.get("env", [])},
        }
        out.append((f"{kind}-{index}", {"command": container["command"], "env": env}))
    return out


def value_of(variable: dict, secrets: dict) -> str:
    """A container's variable as Kubernetes sets it: its value, or its Secret's key's."""
    if "value" in variable:
        return variable["value"]
    ref = variable["valueFrom"]["secretKeyRef"]
    return secrets[ref["name"], ref["key"]]


def test_a_paddlejob_manifest_runs_as_one_job_from_the_operators_environment(
    tmp_path, tiny_data, launched
):
    import yaml

    wrote = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            *scheduled_overrides(tmp_path, tiny_data),
            "cluster.launcher=paddlejob",
            "cluster.image=registry.example/kspipe:1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    (line,) = [line for line in wrote.stdout.splitlines() if "PaddleJob" in line]
    path = Path(line.split("kubectl apply -f ")[1])
    job = yaml.safe_load(path.read_text())
    name = job["metadata"]["name"]
    make = (
        f"kubectl create secret generic {name}-kspipe --from-literal=secret=$(openssl rand -hex 32)"
    )
    assert line == (
        f"kspipe: wrote the PaddleJob {path}; make its secret with {make}, "
        f"then start it with kubectl apply -f {path}"
    )
    assert "KSPIPE_JOB_SECRET=" not in path.read_text()  # the manifest holds no secret
    assert (job["apiVersion"], job["kind"]) == ("batch.paddlepaddle.org/v1", "PaddleJob")
    assert (job["spec"]["ps"]["replicas"], job["spec"]["worker"]["replicas"]) == (1, 2)
    assert run_statuses(tmp_path / "mlflow.db") == []

    pods = []
    try:
        made = {(f"{name}-kspipe", "secret"): "5e" * 32}  # what the kubectl command makes
        for _, pod in operator_environments(job, made):
            command = pod["command"]
            assert command[0] == "kspipe"
            pods.append(
                subprocess.Popen(
                    [sys.executable, "-m", "kspipe.cli.command", *command[1:]],
                    cwd=tmp_path,
                    env=dict(os.environ, **pod["env"], **THREADS),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            time.sleep(1.0)  # pods start when Kubernetes gets to them
        outputs = [p.communicate(timeout=300)[0] for p in pods]
    finally:
        for p in pods:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in pods] == [0, 0, 0], outputs[-1][-3000:]
    folder = tmp_path / "outputs" / f"job-{job['metadata']['name']}"
    got = latest_weights(folder)
    for name, value in launched.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
    # the manifest's token, in every pod, marks the run as this job's (a pod Kubernetes
    # restarts goes on in it: tests/observers/test_earlier_runs.py)
    (token,) = {pod["env"][JOB_TOKEN_ENV] for _, pod in operator_environments(job, made)}
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        tags = dict(con.execute("select key, value from tags"))
    assert (tags["kspipe.job"], tags["kspipe.restarts"], tags["kspipe.run_dir"]) == (
        f"paddlejob-{job['metadata']['name']}-{token}",
        "0",
        str(folder),
    )


def test_every_role_shares_its_hosts_cores_however_it_was_started(monkeypatch):
    """A job's processes get KMP_BLOCKTIME=0 (OpenMP's threads do not spin between steps,
    taking the cores from the job's other processes) from kspipe's plan, and set it
    themselves when a scheduler started them; the user's own value stands.  A kspipe
    command that is not a role of a job leaves it alone."""
    from kspipe.cluster.plan import launch_plan

    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    assert {p.env["KMP_BLOCKTIME"] for p in launch_plan("pserver", 2, 1, threads=1)} == {"0"}
    monkeypatch.setenv("KMP_BLOCKTIME", "30")
    assert {p.env["KMP_BLOCKTIME"] for p in launch_plan("collective", 2)} == {"30"}

    def seen(module, **env):
        base = {
            k: v
            for k, v in os.environ.items()
            if k != "KMP_BLOCKTIME" and not k.startswith(("PADDLE_", "TRAINING_"))
        }
        start = {
            "worker": "from kspipe.cli.worker import main\nmain([])\n",
            "cli": "import sys\nsys.argv = ['kspipe', '--version']\n"
            "from kspipe.cli.command import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n",
        }[module]
        code = start + "import os\nprint(os.environ.get('KMP_BLOCKTIME'))\n"
        return (
            subprocess.run(
                [sys.executable, "-c", code],
                env=dict(base, **env),
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )

    assert seen("worker") == "0"
    assert seen("cli", TRAINING_ROLE="TRAINER") == "0"
    assert seen("cli", PADDLE_TRAINER_ID="1", PADDLE_TRAINER_ENDPOINTS="a:1,b:2") == "0"
    assert seen("cli", TRAINING_ROLE="PSERVER", KMP_BLOCKTIME="30") == "30"
    assert seen("cli") == "None"
