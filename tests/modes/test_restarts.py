"""``cluster.max_restarts``: a job whose process dies starts again from its latest checkpoint
in the same run, on real clusters on loopback.

* kill -9 of a worker and of the server midway through the scheduled sync job (40
  meta-iterations, a checkpoint every 4): the job ends FINISHED, one MLflow run with its
  ``restarts`` metric, and the weights of the uninterrupted run bit for bit;
* a job out of restarts fails as without them, the error counting its failures;
* a worker's own error (a data folder without the data set) is not restarted, and a
  non-finite loss is restarted once, then fails;
* SIGTERM of the launcher stops the job within seconds, with no restart;
* ``cluster.max_restarts=-1`` is one line before anything starts.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kspipe import testing
from kspipe.cluster import secret
from kspipe.launchers.restarts import Failure, Why, restarts
from kspipe.testing import begun_store, run_statuses
from tests.kit import (
    environment_of,
    job_processes,
    latest_weights,
    role_pid,
    scheduled_overrides,
    slurm_missing,
    stopped_when,
)
from tests.kit.slurm import salloc_command


def kspipe(folder: Path, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kspipe.cli.command", *args],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_for(condition, job, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)


def checkpoint_written(run_dir: Path, step: int):
    return lambda: (run_dir / "checkpoints" / f"checkpoint-{step:07d}").is_dir()


def restarts_recorded(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return sorted(con.execute("select step, value from metrics where key = 'restarts'"))


@pytest.mark.parametrize("role, index", [("worker", 1), ("server", 0)])
def test_a_killed_process_restarts_the_job_from_its_checkpoint(
    tmp_path, tiny_data, launched_long, role, index
):
    run_dir = tmp_path / "run"
    job = kspipe(
        tmp_path,
        *scheduled_overrides(tmp_path, tiny_data),
        *launched_long.overrides,
        "cluster.max_restarts=2",
        f"run_dir={run_dir}",
    )
    try:
        wait_for(checkpoint_written(run_dir, 2 * launched_long.every), job)
        pid = role_pid(run_dir, role, index)
        assert pid, (role, index)
        os.kill(pid, signal.SIGKILL)
        _, stderr = job.communicate(timeout=400)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    restarted = [line for line in stderr.splitlines() if " restart 1 of 2 from " in line]
    assert len(restarted) == 1, stderr
    assert restarted[0].startswith(f"kspipe: {role} {index} was killed by SIGKILL; ")
    start = restarted[0].rpartition(" from ")[2]
    assert start.startswith("checkpoint-") and int(start[11:]) >= 2 * launched_long.every
    assert "restart 2 of 2" not in stderr
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
    assert restarts_recorded(tmp_path / "mlflow.db") == [(1, 1.0)]
    listed = (run_dir / "restarts.txt").read_text().splitlines()
    assert listed == [f"1\tsignal\t{role} {index} was killed by SIGKILL\t{start}"]
    assert (run_dir / "logs" / "attempt-1" / f"{role}.{index}.log").is_file()
    # the checkpoint it restarted from was pruned as the run went on: nothing read it again
    assert not (run_dir / "checkpoints" / start).exists()
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("checkpoint-*"))
    assert len(kept) == launched_long.keep, kept
    assert sorted(p.name for p in (run_dir / "checkpoints" / "worker-1").iterdir()) == kept
    got = latest_weights(run_dir)
    assert set(got) == set(launched_long.weights)
    for name, value in launched_long.weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not job_processes(run_dir)


def test_a_job_out_of_restarts_fails_as_without_them(tmp_path, tiny_data, launched_long):
    run_dir = tmp_path / "run"
    job = kspipe(
        tmp_path,
        *scheduled_overrides(tmp_path, tiny_data),
        *launched_long.overrides,
        "cluster.max_restarts=1",
        f"run_dir={run_dir}",
    )
    try:
        log = run_dir / "logs" / "worker.1.log"
        for attempt in range(2):  # each time once it trains
            wait_for(lambda: "meta-train" in log_text(log), job)
            killed = role_pid(run_dir, "worker", 1)
            os.kill(killed, signal.SIGKILL)
            if not attempt:
                wait_for(lambda: (run_dir / "logs" / "attempt-1").is_dir(), job)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("kspipe: error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith("kspipe: error: worker 1 was killed by SIGKILL; its log: ")
    assert "(its 2nd failure, after cluster.max_restarts=1 restarts)" in errors[0]
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
    assert restarts_recorded(tmp_path / "mlflow.db") == [(1, 1.0)]
    assert not job_processes(run_dir)


def log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def test_a_workers_own_error_is_not_restarted(tmp_path, unreadable_data):
    """Every worker reads the data set; images it cannot read are its one-line error."""
    result = testing.run_kspipe(
        *scheduled_overrides(tmp_path, unreadable_data),
        "cluster.max_restarts=2",
        f"run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    testing.assert_one_line_error(result, f"cannot read image {unreadable_data}")
    assert "restart" not in result.stderr
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
    assert not (tmp_path / "run" / "logs" / "attempt-1").exists()


def test_a_non_finite_loss_is_restarted_once(bags_env, tmp_path):
    """bags writes no checkpoint: the job starts again from the beginning, meets the NaN
    again, and fails there."""
    result = testing.run_kspipe(
        "+experiment=bags",
        f"tracking.uri={begun_store(tmp_path)}",
        "bags.nan_from=5",
        "bags.nan_worker=1",
        "mode=pserver",
        "workers=2",
        "servers=1",
        "cluster.strategy=sync",
        "cluster.max_restarts=3",
        f"run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env=bags_env,
    )
    testing.assert_one_line_error(
        result,
        "kspipe: error: worker 1: loss is nan at train step 5 (its log: ",
        "(its 2nd failure, which a restart cannot mend)",
    )
    assert (
        "kspipe: worker 1 stopped: loss is nan at train step 5; restart 1 of 3 from the beginning"
        in (result.stderr)
    )
    assert "restart 2 of 3" not in result.stderr
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]


def test_sigterm_of_the_launcher_stops_the_job_with_no_restart(tmp_path, tiny_data, launched_long):
    run_dir = tmp_path / "run"
    job = kspipe(
        tmp_path,
        *scheduled_overrides(tmp_path, tiny_data),
        *launched_long.overrides,
        "cluster.max_restarts=2",
        f"run_dir={run_dir}",
    )
    written = checkpoint_written(run_dir, launched_long.every)
    stderr = stopped_when(job, written, 180, signal.SIGTERM, within=30)
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert "restart" not in stderr.replace("resume=", "")
    assert run_statuses(tmp_path / "mlflow.db") == ["KILLED"]
    assert not (run_dir / "logs" / "attempt-1").exists()
    assert not job_processes(run_dir)


@pytest.mark.parametrize(
    "value, line", [("-1", "must be at least 0"), ("abc", "must be an integer")]
)
def test_a_bad_max_restarts_is_one_line(tmp_path, value, line):
    result = testing.run_kspipe(
        "mode=pserver", f"cluster.max_restarts={value}", f"run_dir={tmp_path / 'run'}", cwd=tmp_path
    )
    testing.assert_one_line_error(result, f"cluster.max_restarts={value}", line)
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.parametrize(
    "why, left, non_finite_before, restarted",
    [
        (Why.SIGNAL, 1, False, True),
        (Why.SIGNAL, 0, False, False),
        (Why.EXIT, 2, False, True),
        (Why.HOST, 2, False, True),
        (Why.STALLED, 2, False, True),
        (Why.OTHER, 2, False, True),
        (Why.ERROR, 2, False, False),
        (Why.TIMEOUT, 2, False, False),
        (Why.NON_FINITE, 2, False, True),
        (Why.NON_FINITE, 2, True, False),
        (Why.NON_FINITE, 0, False, False),
    ],
)
def test_which_failures_restart(why, left, non_finite_before, restarted):
    assert restarts(Failure(why, "worker 1"), left, non_finite_before) is restarted


def linked_hosts():
    """A first host's and another host's ends of a job's control link, connected."""
    from kspipe.cluster.endpoints import free_ports
    from kspipe.launchers.hosts import HostLink, JobHosts

    control = ("127.0.0.1", free_ports(1)[0])
    hosts = frozenset({"127.0.0.1", "127.0.0.5"})
    first = HostLink(JobHosts("127.0.0.1", "127.0.0.1", hosts, control), 30)
    other = HostLink(JobHosts("127.0.0.5", "127.0.0.1", hosts, control), 30)
    first.open(lambda line: None)
    other.open(lambda line: None)
    deadline = time.monotonic() + 30
    while "127.0.0.5" not in first._peers:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return first, other


@pytest.fixture
def job_secret(monkeypatch):
    """The secret the kspipe command hands every launcher of a job across hosts."""
    monkeypatch.setenv(secret.SECRET_ENV, "ef" * 32)


def test_another_hosts_failure_is_answered_with_a_restart(job_secret):
    """The other host says what failed and how, and waits; the first host's answer names
    the restart and the checkpoint every host starts from."""
    import threading

    first, other = linked_hosts()
    told = threading.Thread(
        target=other.close,
        kwargs={"failure": "worker 1 was killed by SIGKILL", "kind": "signal", "answer_s": 30},
    )
    told.start()
    deadline = time.monotonic() + 30
    while first.failure() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert first.failure() == "the job failed on 127.0.0.5: worker 1 was killed by SIGKILL"
    assert first.failure().why == "signal"
    first.close(failure=first.failure(), restart=1, start="checkpoint-0000008")
    told.join(30)
    assert not told.is_alive()
    assert (other.restart, other.restart_from) == (1, "checkpoint-0000008")


def test_a_restart_reaches_a_host_whose_processes_run(job_secret):
    first, other = linked_hosts()
    first.close(failure="worker 0 exited with status 1", restart=2, start=None)
    deadline = time.monotonic() + 30
    while other.failure() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert other.failure() == "the first host restarts the job: worker 0 exited with status 1"
    assert other.failure().why == "restart"
    assert (other.restart, other.restart_from) == (2, None)
    other.close(failure=other.failure())


def test_a_paddlejob_restarts_no_pod_alone(tmp_path, tiny_data):
    """paddle-operator has no restart count: the manifest's pods never restart alone, and a
    restart count is refused in one line."""
    import yaml

    common = [
        *scheduled_overrides(tmp_path, tiny_data),
        "cluster.launcher=paddlejob",
        "cluster.image=kspipe:test",
        f"run_dir={tmp_path / 'run'}",
    ]
    result = testing.run_kspipe(*common, "cluster.max_restarts=2", cwd=tmp_path)
    testing.assert_one_line_error(
        result, "cluster.max_restarts=2: a PaddleJob cannot restart its pods together"
    )
    assert not (tmp_path / "run" / "paddlejob.yaml").exists()
    result = testing.run_kspipe(*common, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load((tmp_path / "run" / "paddlejob.yaml").read_text())["spec"]
    for kind in ("ps", "worker"):
        assert spec[kind]["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))
def test_a_slurm_job_restarts_its_steps_in_its_allocation(
    tmp_path, tiny_data, launched_long, slurm
):
    """``cluster.launcher=slurm`` inside ``salloc``: a job step killed, the job's new steps
    run in the same allocation and reach the uninterrupted run's weights bit for bit."""
    run_dir = tmp_path / "run"
    overrides = [*launched_long.overrides, "cluster.max_restarts=2"]
    job = subprocess.Popen(
        salloc_command(tmp_path, tiny_data, run_dir, "-n", "3", overrides=overrides),
        cwd=tmp_path,
        env=dict(os.environ, **slurm),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(checkpoint_written(run_dir, 2 * launched_long.every), job)
        victim = role_pid(run_dir, "worker", 1, step=True)
        allocation = environment_of(victim)["SLURM_JOB_ID"]
        assert environment_of(victim).get("SLURM_STEP_ID"), "the role is not a job step"
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: (run_dir / "logs" / "attempt-1").is_dir(), job)
        wait_for(lambda: role_pid(run_dir, "worker", 1, step=True) not in (None, victim), job)
        again = environment_of(role_pid(run_dir, "worker", 1, step=True))
        _, stderr = job.communicate(timeout=400)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert again["SLURM_JOB_ID"] == allocation and again.get("SLURM_STEP_ID")
    assert "kspipe: worker 1 was killed by SIGKILL; restart 1 of 2 from checkpoint-" in stderr
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
    got = latest_weights(run_dir)
    for name, value in launched_long.weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
