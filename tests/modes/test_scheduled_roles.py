"""Jobs whose processes a scheduler starts: each process is ``kspipe <the same overrides>``
with Paddle's environment contract (as Paddle's launcher and a PaddleJob's pods set it),
started seconds apart.  Together they are one kspipe job: one run folder
(``outputs/job-<id>``, Hydra's files in it), one FINISHED MLflow run, and the model that
kspipe's own launcher trains from the same overrides, bit for bit (sync repeats exactly).
"""

import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kspipe.cluster.endpoints import free_ports
from kspipe.job import JOB_TOKEN_ENV
from kspipe.testing import run_statuses
from tests.kit import SCHEDULED_COLLECTIVE, latest_weights, scheduled_overrides

#: what kspipe's launcher gives each process (one math thread each on 2 cores), so that
#: the float sums are the same
THREADS = {"OMP_NUM_THREADS": "1", "KSPIPE_THREADS": "1"}
#: the job's secret, which whoever starts the roles hands to each (kspipe.cluster.secret)
SECRET = {"KSPIPE_JOB_SECRET": "5e" * 32}


def check_one_job(tmp: Path, expected: dict) -> Path:
    """One run folder under ``tmp/outputs`` with the job's model, and one FINISHED run."""
    (folder,) = (tmp / "outputs").iterdir()
    assert folder.name.startswith("job-")
    assert (folder / ".hydra" / "config.yaml").is_file()
    assert (folder / "checkpoints" / "worker-1").is_dir()  # worker 1's state beside worker 0's
    got = latest_weights(folder)
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp / "mlflow.db") == ["FINISHED"]
    return folder


def test_pods_started_apart_with_a_paddlejobs_environment_are_one_job(
    tmp_path, tiny_data, launched
):
    server, worker0, worker1, gloo = free_ports(4)
    job = {
        "PADDLE_PSERVERS_IP_PORT_LIST": f"127.0.0.1:{server}",
        "PADDLE_TRAINER_ENDPOINTS": f"127.0.0.1:{worker0},127.0.0.1:{worker1}",
        "PADDLE_TRAINERS_NUM": "2",
        "POD_IP": "127.0.0.1",
        "PADDLE_WITH_GLOO": "1",
        "PADDLE_GLOO_RENDEZVOUS": "3",
        "PADDLE_GLOO_HTTP_ENDPOINT": f"127.0.0.1:{gloo}",
        **THREADS,
    }
    pods = [
        {"TRAINING_ROLE": "PSERVER", "PADDLE_PORT": str(server)},
        {"TRAINING_ROLE": "TRAINER", "PADDLE_PORT": str(worker0), "PADDLE_TRAINER_ID": "0"},
        {"TRAINING_ROLE": "TRAINER", "PADDLE_PORT": str(worker1), "PADDLE_TRAINER_ID": "1"},
    ]
    started = []
    try:
        for pod in pods:
            started.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kspipe.cli.command",
                        *scheduled_overrides(tmp_path, tiny_data),
                    ],
                    cwd=tmp_path,
                    env=dict(os.environ, **job, **pod, **SECRET),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            time.sleep(1.5)  # a second apart, each would have had a Hydra folder of its own
        outputs = [p.communicate(timeout=300)[0] for p in started]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in started] == [0, 0, 0], outputs[-1][-3000:]
    folder = check_one_job(tmp_path, launched)
    assert f"(run folder {folder})" in outputs[1]


@pytest.mark.parametrize("form", ["pserver", "collective"])
def test_paddles_launcher_starts_one_job(tmp_path, tiny_data, form, request):
    """``python -m paddle.distributed.launch`` with kspipe as its program, in its
    parameter-server and collective forms (it exits 0 even when a worker fails, so the run
    and the weights are what is checked)."""
    kspipe = shutil.which("kspipe")
    assert kspipe, "the kspipe command is installed with the package"
    (gloo,) = free_ports(1)
    if form == "pserver":
        expected, job = request.getfixturevalue("launched"), []
        paddle = ["--server_num=1", "--trainer_num=2", f"--gloo_port={gloo}"]
    else:
        expected, job = request.getfixturevalue("launched_collective"), SCHEDULED_COLLECTIVE
        paddle = ["--nproc_per_node=2"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            *paddle,
            f"--log_dir={tmp_path / 'paddle-logs'}",
            kspipe,
            *scheduled_overrides(tmp_path, tiny_data),
            *job,
        ],
        cwd=tmp_path,
        env=dict(os.environ, **THREADS, **SECRET),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_one_job(tmp_path, expected)


def kspipe_processes(tmp: Path) -> list[str]:
    """Processes still running a command of the job in ``tmp`` (their command lines)."""
    out = subprocess.run(["pgrep", "-af", str(tmp)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.parametrize("form", ["pserver", "collective"])
def test_cluster_launcher_paddle_runs_the_job_under_paddles_launcher(
    tmp_path, tiny_data, form, request
):
    """``cluster.launcher=paddle``: the kspipe command runs ``python -m
    paddle.distributed.launch`` with kspipe's roles as its program; one run folder (the
    command's), one FINISHED run, Paddle's logs in it, and kspipe's own launcher's weights,
    bit for bit."""
    expected = request.getfixturevalue("launched" if form == "pserver" else "launched_collective")
    job = scheduled_overrides(tmp_path, tiny_data) + (
        [] if form == "pserver" else SCHEDULED_COLLECTIVE
    )
    result = subprocess.run(
        [sys.executable, "-m", "kspipe.cli.command", *job, "cluster.launcher=paddle"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (folder,) = (tmp_path / "outputs").glob("*/*")  # the command's own Hydra folder
    got = latest_weights(folder)
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
    logs = sorted(p.name for p in (folder / "logs").iterdir())
    assert {"workerlog.0", "workerlog.1"} <= set(logs), logs
    assert ("serverlog.0" in logs) == (form == "pserver")
    assert result.stdout.strip().splitlines()[-1].startswith("kspipe: done: test_accuracy")
    assert f"(run folder {folder})" in result.stdout
    assert "meta-train 4/4" in result.stderr  # worker 0's progress, from its log
    assert "LAUNCH" not in result.stdout + result.stderr  # Paddle's own lines stay in its log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlruns", "outputs"]
    assert not kspipe_processes(tmp_path)


def test_a_failed_job_under_paddles_launcher_is_one_line(tmp_path, tiny_data):
    """Every worker stops on a data error: the command names one, whatever Paddle's launcher
    exits with, and nothing is left running or RUNNING."""
    empty = tmp_path / "empty"
    empty.mkdir()
    job = [
        o if not o.startswith("dataset.root=") else f"dataset.root={empty}"
        for o in scheduled_overrides(tmp_path, tiny_data)
    ]
    result = subprocess.run(
        [sys.executable, "-m", "kspipe.cli.command", *job, "cluster.launcher=paddle"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error:")]
    assert len(errors) == 1, result.stderr
    assert f"data folder {empty} is empty" in errors[0], errors[0]
    assert errors[0].startswith("kspipe: error: worker ") and "(its log: " in errors[0]
    assert "Traceback" not in result.stderr
    assert "RUNNING" not in run_statuses(tmp_path / "mlflow.db")
    assert not kspipe_processes(tmp_path)


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
    (token,) = {pod["env"][JOB_TOKEN_ENV] for _, pod in operator_environments(job)}
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
