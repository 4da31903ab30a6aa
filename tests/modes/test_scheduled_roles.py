"""Jobs whose processes a scheduler starts: each process is ``kspipe <the same overrides>``
with Paddle's environment contract (as Paddle's launcher and a PaddleJob's pods set it),
started seconds apart.  Together they are one kspipe job: one run folder
(``outputs/job-<id>``, Hydra's files in it), one FINISHED MLflow run, and the model that
kspipe's own launcher trains from the same overrides, bit for bit (sync repeats exactly).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kspipe.cluster.endpoints import free_ports
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


def test_a_failed_job_under_paddles_launcher_is_one_line(tmp_path, unreadable_data):
    """Every worker stops on a data error (images it cannot read, which the command's own
    checks do not open): the command names one, whatever Paddle's launcher exits with,
    and nothing is left running or RUNNING."""
    job = scheduled_overrides(tmp_path, unreadable_data)
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
    assert f"cannot read image {unreadable_data}" in errors[0], errors[0]
    assert errors[0].startswith("kspipe: error: worker ") and "(its log: " in errors[0]
    assert "Traceback" not in result.stderr
    assert "RUNNING" not in run_statuses(tmp_path / "mlflow.db")
    assert not kspipe_processes(tmp_path)
