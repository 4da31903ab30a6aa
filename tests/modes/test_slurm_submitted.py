"""Jobs Slurm runs as a whole, against a real Slurm on loopback: a job kspipe submits with
sbatch, one Slurm requeues (it goes on from its checkpoint, in its MLflow run), and a
sweep of Slurm jobs through submitit (and stopped by Ctrl-C).  The jobs in an allocation
(job steps, their failures) are tests/modes/test_slurm.py's."""

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kspipe.testing import run_statuses
from tests.kit import (
    latest_weights,
    scheduled_overrides,
    slurm_missing,
    stopped_when,
    wait_until,
)
from tests.kit.slurm import nothing_queued, slurm_command

#: Slurm's tests run where a Slurm can be started here (installed, and root: the README
#: installs it so); elsewhere they are skipped, saying why.
needs_slurm = pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else f"no {path}"


@needs_slurm
@pytest.mark.parametrize("requeued_after", [8, 40], ids=["midway", "after-training"])
def test_a_requeued_slurm_job_continues_from_its_checkpoint_by_itself(
    tmp_path, tiny_data, launched_long, slurm, requeued_after
):
    """sbatch --requeue; ``scontrol requeue`` once checkpoint ``requeued_after`` is written
    stops the job and starts it again: it resumes in its own run folder,
    outputs/job-<id>-..., from the newest complete checkpoint there (the requeue lands
    wherever the job has got to by then: midway, or after its last checkpoint, in its final
    evaluation or done), rewrites none up to it, ends with the weights of a run never
    interrupted (``launched_long``), and goes on in its first run: one MLflow run,
    FINISHED, with one restart."""
    job = [*scheduled_overrides(tmp_path, tiny_data), *launched_long.overrides]
    last = f"checkpoint-{launched_long.iterations:07d}"

    script = tmp_path / "job.sbatch"
    command = " ".join(
        f"'{a}'"
        for a in [sys.executable, "-m", "kspipe.cli.command", *job, "cluster.launcher=slurm"]
    )
    script.write_text(
        f"#!/bin/bash\n#SBATCH -n 3\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
        f"#SBATCH -o {tmp_path}/slurm-%j.out\nexec {command}\n"
    )
    submitted = slurm_command(slurm, "sbatch", "--parsable", f"--chdir={tmp_path}", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    out = tmp_path / f"slurm-{job_id}.out"

    def run_folders():  # outputs/job-<id>-<the command's digest>
        return list((tmp_path / "outputs").glob(f"job-{job_id}-*"))

    first = f"checkpoint-{requeued_after:07d}"

    def reached() -> bool:  # that checkpoint or a later one (it keeps 2: 8 goes soon)
        names = [p.name for r in run_folders() for p in (r / "checkpoints").glob("checkpoint-*")]
        return any(not n.endswith(".tmp") and n >= first for n in names)

    wait_until(reached, 300, lambda: f"no {first} or later: {tail(out)}")
    (run,) = run_folders()
    assert slurm_command(slurm, "scontrol", "requeue", job_id).returncode == 0
    # Slurm holds a requeued job ~2 minutes (BeginTime); let it go at once
    wait_until(
        lambda: (
            slurm_command(slurm, "squeue", "-h", "-j", job_id, "-o", "%r").stdout.strip()
            == "BeginTime"
        ),
        120,
        lambda: f"the job was not requeued: {tail(out)}",
    )

    def files_up_to(iteration):  # each file of the checkpoints up to it: inode and mtime
        folders = [
            f
            for f in (run / "checkpoints").glob("**/checkpoint-*")
            if f.suffix != ".tmp" and int(f.name.removeprefix("checkpoint-")) <= iteration
        ]
        return {
            path: (path.stat().st_ino, path.stat().st_mtime_ns)
            for folder in folders
            for path in folder.rglob("*")
            if path.is_file()
        }

    # the first run's newest complete checkpoint (the first worker's, which it writes once
    # every other worker has written its own part), and those before it as it left them (a
    # worker may have written its own part of the next one, which the second run writes
    # again)
    latest = max(
        int(p.name.removeprefix("checkpoint-"))
        for p in (run / "checkpoints").glob("checkpoint-*")
        if p.suffix != ".tmp"
    )
    complete = [p.name for p in (run / "checkpoints").glob("checkpoint-*") if p.suffix != ".tmp"]
    assert all((run / "checkpoints" / "worker-1" / name).is_dir() for name in complete)
    stopped = files_up_to(latest)
    slurm_command(slurm, "scontrol", "update", f"JobId={job_id}", "StartTime=now")
    wait_until(
        lambda: nothing_queued(slurm), 600, lambda: f"the requeued job did not finish: {tail(out)}"
    )
    output = out.read_text()
    resumed = run / "checkpoints" / f"checkpoint-{latest:07d}"
    assert (
        f"Slurm requeued the job (restart 1): it resumes from its latest complete "
        f"checkpoint, {resumed}\n" in output
    ), output[-3000:]
    # it went on from the newest of them, which it left as they were, as it left those
    # before: a run from the start (which ends with the same weights) would have written
    # them again
    import re

    assert set(re.findall(r"resuming from meta-iteration (\d+) ", output)) == {str(latest)}, (
        latest,
        output[-3000:],
    )
    # those of them still there are as it left them; midway, the run went on long enough
    # to prune the one it resumed from (the end of the run does not read it again)
    left = files_up_to(latest)
    assert all(stopped.get(path) == seen for path, seen in left.items()), left
    if latest < launched_long.iterations - launched_long.every * launched_long.keep:
        assert not resumed.exists()
    assert run_folders() == [run]  # the requeued job found its own folder
    with open(run / "checkpoints" / last / "state.pdparams", "rb") as f:
        got = pickle.load(f)
    assert set(got) == set(launched_long.weights)
    for name, value in launched_long.weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # one MLflow run for the job: its first attempt's, gone on from the checkpoint
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"], output[-3000:]
    (recorded,) = runs_of(tmp_path / "mlflow.db")
    tags = recorded.data.tags
    assert (tags["kspipe.job"], tags["kspipe.restarts"], tags["kspipe.resumed_from"]) == (
        f"slurm-{job_id}",
        "1",
        str(resumed),
    )
    assert f"kspipe: the job's MLflow run {recorded.info.run_id} goes on (restart 1; " in output
    # the final metrics at the last step (the first attempt may have logged them too)
    steps = {m.step for m in history(tmp_path / "mlflow.db", recorded, "test_accuracy")}
    assert steps == {launched_long.iterations}


def runs_of(db: Path) -> list:
    """Every run in the MLflow store ``db``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def history(db: Path, run, metric: str) -> list:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{db}").get_metric_history(run.info.run_id, metric)


@needs_slurm
def test_outside_an_allocation_kspipe_submits_the_job_with_sbatch(
    tmp_path, tiny_data, launched, slurm
):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            *scheduled_overrides(tmp_path, tiny_data),
            "cluster.launcher=slurm",
            f"run_dir={run}",
            "cluster.slurm_args=['--job-name=bags']",
        ],
        cwd=tmp_path,
        env=dict(env, **slurm),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if "submitted Slurm job" in line]
    job = line.split("submitted Slurm job ")[1].split(";")[0]
    assert line == (
        f"kspipe: submitted Slurm job {job}; follow it with squeue -j {job} and "
        f"{run / f'slurm-{job}.out'}"
    )
    assert "#SBATCH --job-name=bags" in (run / "kspipe.sbatch").read_text()
    wait_until(
        lambda: nothing_queued(slurm),
        600,
        lambda: f"the job did not finish: {tail(run / f'slurm-{job}.out')}",
    )
    got = latest_weights(run)
    for name, value in launched.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"], tail(run / f"slurm-{job}.out")


def submitit_sweep(tmp_path, tiny_data) -> list:
    """``kspipe -m hydra/launcher=submitit_slurm`` over the tiny job, ``workers=`` left to
    the test (each job of the sweep a Slurm job of hydra-submitit-launcher's)."""
    job = [o for o in scheduled_overrides(tmp_path, tiny_data) if not o.startswith("workers=")]
    command = [sys.executable, "-m", "kspipe.cli.command", "-m", "hydra/launcher=submitit_slurm"]
    return [*command, "hydra.launcher.mem_gb=null", *job]


def outside_any_allocation(slurm: dict) -> dict:
    """The local Slurm's environment without this process's own ``SLURM_*`` variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return dict(env, **slurm)


@needs_slurm
def test_a_sweep_runs_each_job_as_a_slurm_job_with_submitit(tmp_path, tiny_data, launched, slurm):
    """``kspipe -m hydra/launcher=submitit_slurm``: each job of the sweep is a Slurm job
    (hydra-submitit-launcher's), the parent and child runs are a local sweep's, and the
    workers=2 job trains what kspipe's own launcher does, bit for bit."""
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [*submitit_sweep(tmp_path, tiny_data), "workers=1,2", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        env=outside_any_allocation(slurm),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kspipe: best: workers=" in result.stderr
    logs = sorted((sweep / ".submitit").glob("*_*/*_log.out"))  # <Slurm job>_<task>
    assert len(logs) == 2
    for log in logs:
        assert "kspipe: done: test_accuracy" in log.read_text(), tail(log)
    # the sweep's parent and its two jobs
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"] * 3
    got = latest_weights(sweep / "1")  # workers=2
    for name, value in launched.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert nothing_queued(slurm)


@needs_slurm
def test_a_submitit_sweep_stopped_by_ctrl_c_cancels_its_slurm_jobs(tmp_path, tiny_data, slurm):
    """Ctrl-C while the command waits for its sweep's Slurm jobs: the jobs are cancelled
    (Slurm's SIGTERM stops each at a safe point, its run KILLED), not left running on the
    cluster, and the parent run ends KILLED."""
    sweep = tmp_path / "sweep"
    command = subprocess.Popen(
        [
            *submitit_sweep(tmp_path, tiny_data),
            "workers=1",
            "train.meta_iters=100000",
            "train.checkpoint_every=2",
            "eval.interval=0",
            "task.ways=3,4",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env=outside_any_allocation(slurm),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = stopped_when(
        command, lambda: all(list(sweep.glob(f"{i}/checkpoints/checkpoint-*")) for i in (0, 1)), 300
    )
    assert command.returncode == 128 + signal.SIGINT, stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("kspipe: error:")]
    assert line.startswith(
        "kspipe: error: stopped by SIGINT; the sweep's parent run is "
        "recorded as KILLED; its Slurm jobs still queued or running ("
    )
    assert line.endswith(") are cancelled (a running one stops at its next safe point)")
    assert nothing_queued(slurm, 60)
    assert run_statuses(tmp_path / "mlflow.db") == ["KILLED"] * 3  # the parent, both jobs
