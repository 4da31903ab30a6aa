"""Jobs in a Slurm allocation (``cluster.launcher=slurm``), run against a real Slurm on
loopback (one node, or two slurmd on this host): the processes as job steps, across
nodes, their failures, and the weights kspipe's own launcher reaches, bit for bit.  Jobs
Slurm runs as a whole (sbatch, requeued, submitit sweeps) are
tests/modes/test_slurm_submitted.py's."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kspipe.testing import run_statuses
from tests.kit import (
    SCHEDULED_COLLECTIVE,
    environment_of,
    job_processes,
    scheduled_overrides,
    slurm_missing,
    wait_until,
)
from tests.kit.slurm import allocated_job, nothing_queued, salloc_command

#: Slurm's tests run where a Slurm can be started here (installed, and root: the README
#: installs it so); elsewhere they are skipped, saying why.
needs_slurm = pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))


@pytest.mark.parametrize("kind", ["pserver", "collective"])
def test_a_slurm_jobs_gloo_meeting_point_is_a_port_drawn_free(kind, monkeypatch):
    """The meeting point is drawn free with the endpoints, never the first endpoint's port
    + 1: Linux draws free ports odd and outgoing connections' even, so that port was taken
    now and then on a busy node (it failed a CI run)."""
    from omegaconf import OmegaConf

    from kspipe.launchers import slurm as slurm_launcher

    drawn = [41001, 41011, 41021, 41031]  # what free_ports draws here, none the + 1 of another
    monkeypatch.setattr(
        "kspipe.cluster.endpoints.free_ports", lambda count, host="127.0.0.1": drawn[:count]
    )
    monkeypatch.setattr("kspipe.cluster.plan.check_port_free", lambda host, port: None)
    monkeypatch.setattr(slurm_launcher, "allocation_hosts", lambda env=None: ["node1"])
    cfg = OmegaConf.create({"workers": 2, "servers": 1, "cluster": {}})
    servers = 1 if kind == "pserver" else None
    plan = slurm_launcher.SlurmLauncher().plan(kind, cfg, 2, servers, threads=1)
    meeting = (
        plan[0].env["PADDLE_GLOO_HTTP_ENDPOINT"]
        if kind == "pserver"
        else plan[0].env["KSPIPE_GLOO_ENDPOINT"]
    )
    assert [p.endpoint for p in plan] == [f"127.0.0.1:{port}" for port in drawn[: len(plan)]]
    assert meeting == f"127.0.0.1:{drawn[len(plan)]}"


@needs_slurm
def test_a_job_in_a_slurm_allocation_runs_its_processes_as_job_steps(
    tmp_path, tiny_data, launched, slurm
):
    run = allocated_job(tmp_path, tiny_data, slurm, launched, "-n", "3")
    assert sorted(p.name for p in (run / "logs").iterdir()) == [
        "server.0.log",
        "worker.0.log",
        "worker.1.log",
    ]
    assert nothing_queued(slurm)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A Slurm of two nodes (two slurmd on this host, at 127.0.0.1 and 127.0.0.2)."""
    from tests.kit import local_slurm

    folder = tmp_path_factory.mktemp("slurm-two-nodes")
    with local_slurm(folder, nodes=2) as env:
        yield folder, env


@needs_slurm
def test_a_job_across_two_slurm_nodes_runs_a_step_on_each(tmp_path, tiny_data, launched, two_nodes):
    """An allocation of two nodes: the processes go to the nodes in turn (worker 0 to the
    second, at its NodeAddr), and the job reaches kspipe's own launcher's weights."""
    folder, slurm = two_nodes
    run = allocated_job(tmp_path, tiny_data, slurm, launched, "-N", "2", "-n", "3")
    assert "launch task StepId=" in (folder / "slurmd-node2.log").read_text()
    assert "127.0.0.2:" in (run / "logs" / "worker.0.log").read_text()
    assert nothing_queued(slurm)


@needs_slurm
@pytest.mark.parametrize(
    "allocate, message",
    [
        (
            ["salloc", "-n", "2", "--quiet"],
            "the Slurm allocation (job {}) has 2 task(s); this job "
            "needs 3 (one per server and worker)",
        ),
        ([], "cluster.launcher='nope' is not one of paddle, paddlejob, processes, slurm"),
    ],
)
def test_a_slurm_launch_that_cannot_run_is_one_line(tmp_path, tiny_data, slurm, allocate, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        [
            *allocate,
            sys.executable,
            "-m",
            "kspipe.cli.command",
            *scheduled_overrides(tmp_path, tiny_data),
            f"cluster.launcher={'slurm' if allocate else 'nope'}",
            f"run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=dict(env, **slurm),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error")]
    prefix = message.split("{}")[0]
    assert prefix in line and message.split("{}")[-1] in line, result.stderr
    assert "Traceback" not in result.stderr
    assert run_statuses(tmp_path / "mlflow.db") == []
    assert nothing_queued(slurm)


def task_processes(run: Path) -> list[int]:
    """The job's roles still running, not the srun commands that started them."""
    return [pid for pid in job_processes(run) if not command_of(pid).startswith("srun")]


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@needs_slurm
def test_a_job_step_that_dies_ends_the_slurm_job_within_a_minute(tmp_path, tiny_data, slurm):
    run = tmp_path / "run"
    job = subprocess.Popen(
        salloc_command(tmp_path, tiny_data, run, "-n", "3", overrides=["train.meta_iters=100000"]),
        cwd=tmp_path,
        env=dict(os.environ, **slurm),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        victim = None
        while victim is None:
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.5)
            log = run / "logs" / "worker.1.log"
            if log.is_file() and "meta-train" in log.read_text(errors="replace"):
                victim = next(
                    (
                        pid
                        for pid in task_processes(run)
                        if environment_of(pid).get("TRAINING_ROLE") == "TRAINER"
                        and environment_of(pid).get("PADDLE_TRAINER_ID") == "1"
                    ),
                    None,
                )
        assert environment_of(victim).get("SLURM_STEP_ID"), "the role is not a job step"
        os.kill(victim, 9)
        killed = time.monotonic()
        _, stderr = job.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "kspipe: error: worker 1" in stderr, stderr[-3000:]
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
    # within a minute of the kill: the job ended, and left nothing queued or running
    wait_until(
        lambda: nothing_queued(slurm, 0) and job_processes(run) == [],
        60 - took,
        lambda: f"left: {[command_of(p) for p in job_processes(run)]}",
    )


@needs_slurm
def test_a_collective_job_in_a_slurm_allocation_trains_what_the_launcher_does(
    tmp_path, tiny_data, launched_collective, slurm
):
    allocated_job(
        tmp_path, tiny_data, slurm, launched_collective, "-n", "2", overrides=SCHEDULED_COLLECTIVE
    )
    assert nothing_queued(slurm)
