"""``cluster.stall_seconds``: a process of a cluster job that makes no progress for that long
fails the job in one line naming it and what it was doing, and nothing is left running.

* A worker or a server stopped with SIGSTOP (parameter servers, sync and async) is found
  within ``stall_seconds`` + 30 s: the job ends FAILED (exit 3) with one line
  naming that process, and every process of the job is gone (the stopped one killed).
* A healthy job whose first worker works 35 s without a training step while the other
  waits for it in the sync round's sum, with ``stall_seconds=30``, is not stopped.
* ``stall_seconds`` of 0 or less is one line before anything starts.
* The launcher's rules (kspipe/launchers/stalls.py), on progress files written here with a
  clock and process states of the test's own: a process waiting while another makes
  progress is not stalled; one stuck in its own work is; a wait no process of the job
  leaves is; a stopped process is named before the ones that wait on it; a process that
  ended or whose progress file says it serves is not judged by its steps.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kspipe import testing
from kspipe.errors import Stalled
from kspipe.launchers.stalls import StallWatch
from tests.kit import job_processes

PSERVER = ["mode=pserver", "workers=2", "servers=1"]
STOPPED = {
    "sync-worker": ([*PSERVER, "cluster.strategy=sync"], "worker 1"),
    "sync-server": ([*PSERVER, "cluster.strategy=sync"], "server 0"),
    "async-worker": ([*PSERVER, "cluster.strategy=async"], "worker 1"),
    "async-server": ([*PSERVER, "cluster.strategy=async"], "server 0"),
}
#: Above any phase of setting up on a 2-core machine under a load of 15 (compiling: 20 s).
LIMIT_S = 30


def kspipe(env, folder, *overrides):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "+experiment=bags",
            f"tracking.uri={testing.begun_store(folder)}",
            *overrides,
            f"run_dir={folder / 'run'}",
        ],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def progress(run, name: str) -> dict:
    try:
        return json.loads((run / "logs" / f"{name.replace(' ', '.')}.progress").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.parametrize("case", list(STOPPED))
def test_a_stopped_process_fails_the_job_in_one_line(bags_env, tmp_path, case):
    overrides, name = STOPPED[case]
    run = tmp_path / "run"
    job = kspipe(
        bags_env, tmp_path, *overrides, "bags.epochs=1000", f"cluster.stall_seconds={LIMIT_S}"
    )
    try:
        deadline = time.monotonic() + 180
        while (progress(run, "worker 1").get("step") or 0) < 5:  # training, every process
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()[1][-2000:]
            time.sleep(0.1)
        os.kill(progress(run, name)["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = job.communicate(timeout=LIMIT_S + 60)
        took = time.monotonic() - stopped
    finally:
        if job.poll() is None:
            job.kill()
    result = subprocess.CompletedProcess(job.args, job.returncode, "", stderr)
    testing.assert_one_line_error(
        result,
        f"kspipe: error: {name} has been stopped (SIGSTOP or SIGTSTP) for ",
        f"; cluster.stall_seconds={LIMIT_S}); its log: {run / 'logs' / name.replace(' ', '.')}.log",
    )
    assert job.returncode == 3
    assert LIMIT_S <= took < LIMIT_S + 30, took
    assert testing.run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
    assert not job_processes(run)


def test_a_worker_waiting_while_another_works_is_not_stalled(bags_env, tmp_path):
    job = kspipe(
        bags_env,
        tmp_path,
        *PSERVER,
        "cluster.strategy=sync",
        "bags.epochs=1",
        "bags.pause_at=10",
        f"bags.pause_seconds={LIMIT_S + 5}",
        f"cluster.stall_seconds={LIMIT_S}",
    )
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    assert (
        f"pause {LIMIT_S + 5}/{LIMIT_S + 5}"
        in (tmp_path / "run" / "logs" / "worker.0.log").read_text()
    )
    assert testing.run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_stall_limit_not_above_0_is_one_line(bags_env, tmp_path, value):
    result = testing.run_kspipe(
        "+experiment=bags",
        *PSERVER,
        f"cluster.stall_seconds={value}",
        f"run_dir={tmp_path / 'run'}",
        "tracking.enabled=false",
        cwd=tmp_path,
        env=bags_env,
    )
    testing.assert_one_line_error(
        result, f"kspipe: error: cluster.stall_seconds={value} must be more than 0 (null: never "
    )
    assert not (tmp_path / "run" / "logs").exists()


class Job:
    """Progress files in ``folder``, a clock and process states of the test's own."""

    def __init__(self, folder):
        self.folder, self.now, self.states = folder, 0.0, {}
        self.watch = StallWatch(
            str(folder), 10, clock=lambda: self.now, states=self.state, host="h"
        )

    def state(self, pid):
        return self.states.get(pid, "S")

    def write(self, pid, name, beats, **fields):
        fields = {
            "name": name, "pid": pid, "host": "h", "beats": beats, "task": "train",
            "step": beats, "phase": "training", "waiting": False, "serving": False,
            "ended": False, **fields,
        }  # fmt: skip
        (self.folder / f"{name.replace(' ', '.')}.progress").write_text(json.dumps(fields))

    def at(self, now) -> Stalled | None:
        self.now = now
        return self.watch.check()


def test_the_launchers_rules(tmp_path):
    job = Job(tmp_path)
    job.write(1, "worker 0", 1)
    job.write(2, "worker 1", 1, phase="in the sync round's sum", waiting=True)
    job.write(3, "server 0", 1, phase="serving", serving=True)
    assert job.at(0) is None
    for t in range(1, 15):  # worker 0 works (an evaluation), worker 1 waits for it
        job.write(1, "worker 0", 1 + t, task="evaluate")
        assert job.at(t) is None
    assert str(job.at(26)) == (  # worker 0 is stuck in its own work (its last change: 14)
        "worker 0 made no progress for 12 s (last evaluate step 15, training; "
        "cluster.stall_seconds=10)"
    )
    job.write(1, "worker 0", 40, phase="in the sync round's sum", waiting=True)
    assert job.at(30) is None  # both wait now, both since less than 10 s
    assert str(job.at(41)) == (  # worker 1 waited longest; no process made progress
        "worker 1 made no progress for 41 s, nor did any other process of the job (last "
        "train step 1, in the sync round's sum; cluster.stall_seconds=10)"
    )
    job.states[3] = "T"  # the server is stopped: the cause, however long
    assert str(job.at(42)) == (
        "server 0 has been stopped (SIGSTOP or SIGTSTP) for 0 s (last train step 1, serving; "
        "cluster.stall_seconds=10)"
    )
    job.states[3] = "t"
    assert str(job.at(43)).startswith("server 0 has been stopped (by a debugger) for 1 s (")
    for pid in (1, 2):
        job.states[pid] = None  # the workers are gone: the server alone is judged by its state
    assert job.at(52) is None  # stopped since 42: not yet 10 s
    assert str(job.at(53)).startswith("server 0 has been stopped (by a debugger) for 11 s (")
    job.states[3] = "S"
    assert job.at(54) is None  # a server serving is judged by its state alone
    job.write(3, "server 0", 2, phase="ended", ended=True)
    job.states[3] = "T"
    assert job.at(80) is None  # it ended (its pid may be another process's now)


def test_a_process_stopped_before_it_wrote_its_file_is_the_one_named(tmp_path):
    """Worker 0 stopped right after it started, before its first word: the others then
    wait on it and make no progress either; the stopped one is the cause (the launcher
    knows its pid) and is named, not the one that waited longest."""
    job = Job(tmp_path)
    job.write(2, "worker 1", 1, phase="joining the job", waiting=True)
    job.states[1] = "T"
    pids = {"worker 0": 1, "worker 1": 2}
    job.now = 0
    assert job.watch.check(pids=pids) is None
    job.now = 11
    assert str(job.watch.check(pids=pids)) == (
        "worker 0 has been stopped (SIGSTOP or SIGTSTP) for 11 s (starting; "
        "cluster.stall_seconds=10)"
    )
    job.states[1] = "S"  # not stopped: a process without a file yet is never a stall
    job.now = 30
    assert "worker 1 made no progress" in str(job.watch.check(pids=pids))
