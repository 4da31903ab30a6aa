"""Jobs whose processes a scheduler starts: each process is ``kspipe <the same overrides>``
with Paddle's environment contract (as Paddle's launcher and a PaddleJob's pods set it),
started seconds apart.  Together they are one kspipe job: one run folder
(``outputs/job-<id>``, Hydra's files in it), one FINISHED MLflow run, and the model that
kspipe's own launcher trains from the same overrides, bit for bit (sync repeats exactly).
"""

import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kspipe.endpoints import free_ports
from kspipe.testing import job_processes, run_statuses, slurm_missing, tiny_overrides

ITERATIONS = 4
JOB = ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=sync"]
#: what kspipe's launcher gives each process (one math thread each on 2 cores), so that
#: the float sums are the same
THREADS = {"OMP_NUM_THREADS": "1", "KSPIPE_THREADS": "1"}


def overrides(tmp: Path, tiny_data) -> list[str]:
    """The tiny Reptile job without a run folder: the processes find theirs."""
    return ["+experiment=omniglot_5way", f"train.meta_iters={ITERATIONS}",
            *[o for o in tiny_overrides(tmp, tiny_data) if not o.startswith("run_dir=")], *JOB]


def final_weights(run_dir: Path) -> dict:
    path = run_dir / "checkpoints" / f"checkpoint-{ITERATIONS:07d}" / "state.pdparams"
    with open(path, "rb") as f:
        return pickle.load(f)


#: Slurm's tests run where a one-node Slurm can be started (installed, and root: the
#: README installs it so); elsewhere they are skipped, saying why.
needs_slurm = pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_data):
    """The same job started by kspipe's own launcher: the reference weights."""
    tmp = tmp_path_factory.mktemp("launched")
    result = subprocess.run([sys.executable, "-m", "kspipe.cli", *overrides(tmp, tiny_data),
                             f"run_dir={tmp / 'run'}"], cwd=tmp, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return final_weights(tmp / "run")


def check_one_job(tmp: Path, expected: dict) -> Path:
    """One run folder under ``tmp/outputs`` with the job's model, and one FINISHED run."""
    (folder,) = (tmp / "outputs").iterdir()
    assert folder.name.startswith("job-")
    assert (folder / ".hydra" / "config.yaml").is_file()
    assert (folder / "checkpoints" / "worker-1").is_dir()  # worker 1's state beside worker 0's
    got = final_weights(folder)
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp / "mlflow.db") == ["FINISHED"]
    return folder


def test_pods_started_apart_with_a_paddlejobs_environment_are_one_job(
        tmp_path, tiny_data, launched):
    server, worker0, worker1, gloo = free_ports(4)
    job = {"PADDLE_PSERVERS_IP_PORT_LIST": f"127.0.0.1:{server}",
           "PADDLE_TRAINER_ENDPOINTS": f"127.0.0.1:{worker0},127.0.0.1:{worker1}",
           "PADDLE_TRAINERS_NUM": "2", "POD_IP": "127.0.0.1", "PADDLE_WITH_GLOO": "1",
           "PADDLE_GLOO_RENDEZVOUS": "3", "PADDLE_GLOO_HTTP_ENDPOINT": f"127.0.0.1:{gloo}",
           **THREADS}
    pods = [{"TRAINING_ROLE": "PSERVER", "PADDLE_PORT": str(server)},
            {"TRAINING_ROLE": "TRAINER", "PADDLE_PORT": str(worker0), "PADDLE_TRAINER_ID": "0"},
            {"TRAINING_ROLE": "TRAINER", "PADDLE_PORT": str(worker1), "PADDLE_TRAINER_ID": "1"}]
    started = []
    try:
        for pod in pods:
            started.append(subprocess.Popen(
                [sys.executable, "-m", "kspipe.cli", *overrides(tmp_path, tiny_data)],
                cwd=tmp_path, env=dict(os.environ, **job, **pod), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
            time.sleep(1.5)  # a second apart, each would have had a Hydra folder of its own
        outputs = [p.communicate(timeout=300)[0] for p in started]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in started] == [0, 0, 0], outputs[-1][-3000:]
    folder = check_one_job(tmp_path, launched)
    assert f"(run folder {folder})" in outputs[1]


def test_paddles_launcher_starts_one_job(tmp_path, tiny_data, launched):
    """``python -m paddle.distributed.launch`` with kspipe as its program (it exits 0 even
    when a worker fails, so the run and the weights are what is checked)."""
    kspipe = shutil.which("kspipe")
    assert kspipe, "the kspipe command is installed with the package"
    (gloo,) = free_ports(1)
    result = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--server_num=1",
         "--trainer_num=2", f"--gloo_port={gloo}", f"--log_dir={tmp_path / 'paddle-logs'}",
         kspipe, *overrides(tmp_path, tiny_data)],
        cwd=tmp_path, env=dict(os.environ, **THREADS), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    check_one_job(tmp_path, launched)


COLLECTIVE = ["mode=collective", "workers=2"]


@pytest.fixture(scope="module")
def launched_collective(tmp_path_factory, tiny_data):
    """The collective job started by kspipe's own launcher: the reference weights."""
    tmp = tmp_path_factory.mktemp("launched-collective")
    result = subprocess.run([sys.executable, "-m", "kspipe.cli", *overrides(tmp, tiny_data),
                             *COLLECTIVE, f"run_dir={tmp / 'run'}"], cwd=tmp,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return final_weights(tmp / "run")


def kspipe_processes(tmp: Path) -> list[str]:
    """Processes still running a command of the job in ``tmp`` (their command lines)."""
    out = subprocess.run(["pgrep", "-af", str(tmp)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.parametrize("form", ["pserver", "collective"])
def test_cluster_launcher_paddle_runs_the_job_under_paddles_launcher(
        tmp_path, tiny_data, form, request):
    """``cluster.launcher=paddle``: the kspipe command runs ``python -m
    paddle.distributed.launch`` with kspipe's roles as its program; one run folder (the
    command's), one FINISHED run, Paddle's logs in it, and kspipe's own launcher's weights,
    bit for bit."""
    expected = request.getfixturevalue("launched" if form == "pserver" else "launched_collective")
    job = overrides(tmp_path, tiny_data) + ([] if form == "pserver" else COLLECTIVE)
    result = subprocess.run([sys.executable, "-m", "kspipe.cli", *job, "cluster.launcher=paddle"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (folder,) = (tmp_path / "outputs").glob("*/*")  # the command's own Hydra folder
    got = final_weights(folder)
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
    job = [o if not o.startswith("dataset.root=") else f"dataset.root={empty}"
           for o in overrides(tmp_path, tiny_data)]
    result = subprocess.run([sys.executable, "-m", "kspipe.cli", *job, "cluster.launcher=paddle"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error:")]
    assert len(errors) == 1, result.stderr
    assert f"data folder {empty} is empty" in errors[0], errors[0]
    assert errors[0].startswith("kspipe: error: worker ") and "(its log: " in errors[0]
    assert "Traceback" not in result.stderr
    assert "RUNNING" not in run_statuses(tmp_path / "mlflow.db")
    assert not kspipe_processes(tmp_path)


@pytest.mark.parametrize("environment, message", [
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1",
      "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7000", "PADDLE_WITH_GLOO": "1",
      "PADDLE_GLOO_RENDEZVOUS": "3", "PADDLE_GLOO_HTTP_ENDPOINT": "127.0.0.1:7001"},
     "TRAINER: PADDLE_PSERVERS_IP_PORT_LIST not set in the environment"),
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "2", "PADDLE_TRAINERS_NUM": "2",
      "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:7002",
      "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7000,127.0.0.1:7003", "PADDLE_WITH_GLOO": "1",
      "PADDLE_GLOO_RENDEZVOUS": "3", "PADDLE_GLOO_HTTP_ENDPOINT": "127.0.0.1:7001"},
     "PADDLE_TRAINER_ID=2 is not one of the 2 workers of PADDLE_TRAINER_ENDPOINTS"),
    ({"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:7002",
      "PADDLE_TRAINERS_NUM": "1", "POD_IP": "127.0.0.1", "PADDLE_PORT": "7002"},
     "a parameter-server job's processes meet through fleet's gloo"),
    ({"TRAINING_ROLE": "HETER_TRAINER"}, "TRAINING_ROLE=HETER_TRAINER: a parameter-server "
                                         "job's process is PSERVER or TRAINER"),
])
def test_an_environment_missing_what_a_role_needs_is_one_line(tmp_path, tiny_data,
                                                              environment, message):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PADDLE_", "TRAINING_ROLE", "POD_IP"))}
    result = subprocess.run([sys.executable, "-m", "kspipe.cli", *overrides(tmp_path, tiny_data)],
                            cwd=tmp_path, env=dict(clean, **environment), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("kspipe: error: ") and message in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert run_statuses(tmp_path / "mlflow.db") == []


# --- Slurm ---------------------------------------------------------------------------


def slurm_command(env: dict, *command, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=timeout)


def nothing_queued(env: dict, within_s: float = 30) -> bool:
    """Whether Slurm's queue empties within ``within_s`` (a job that ended may still be
    completing for a moment)."""
    deadline = time.monotonic() + within_s
    while slurm_command(env, "squeue", "-h").stdout.strip():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def allocated_job(tmp: Path, tiny_data, slurm: dict, expected: dict, *salloc) -> Path:
    """The tiny job run by ``salloc <salloc> kspipe ... cluster.launcher=slurm``: it
    succeeds, reaches the ``expected`` weights bit for bit and records one FINISHED run;
    its run folder."""
    run = tmp / "run"
    result = subprocess.run(
        ["salloc", *salloc, "--quiet", sys.executable, "-m", "kspipe.cli",
         *overrides(tmp, tiny_data), "cluster.launcher=slurm", f"run_dir={run}"],
        cwd=tmp, env=dict(os.environ, **slurm), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = final_weights(run)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp / "mlflow.db") == ["FINISHED"]
    return run


@needs_slurm
def test_a_job_in_a_slurm_allocation_runs_its_processes_as_job_steps(
        tmp_path, tiny_data, launched, slurm):
    run = allocated_job(tmp_path, tiny_data, slurm, launched, "-n", "3")
    assert sorted(p.name for p in (run / "logs").iterdir()) == [
        "server.0.log", "worker.0.log", "worker.1.log"]
    assert nothing_queued(slurm)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A Slurm of two nodes (two slurmd on this host, at 127.0.0.1 and 127.0.0.2)."""
    from kspipe.testing import local_slurm

    folder = tmp_path_factory.mktemp("slurm-two-nodes")
    with local_slurm(folder, nodes=2) as env:
        yield folder, env


@needs_slurm
def test_a_job_across_two_slurm_nodes_runs_a_step_on_each(tmp_path, tiny_data, launched,
                                                          two_nodes):
    """An allocation of two nodes: the processes go to the nodes in turn (worker 0 to the
    second, at its NodeAddr), and the job reaches kspipe's own launcher's weights."""
    folder, slurm = two_nodes
    run = allocated_job(tmp_path, tiny_data, slurm, launched, "-N", "2", "-n", "3")
    assert "launch task StepId=" in (folder / "slurmd-node2.log").read_text()
    assert "127.0.0.2:" in (run / "logs" / "worker.0.log").read_text()
    assert nothing_queued(slurm)


@needs_slurm
@pytest.mark.parametrize("allocate, message", [
    (["salloc", "-n", "2", "--quiet"], "the Slurm allocation (job {}) has 2 task(s); this job "
                                       "needs 3 (one per server and worker)"),
    ([], "cluster.launcher='nope' is not one of paddle, paddlejob, processes, slurm"),
])
def test_a_slurm_launch_that_cannot_run_is_one_line(tmp_path, tiny_data, slurm, allocate,
                                                   message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        [*allocate, sys.executable, "-m", "kspipe.cli", *overrides(tmp_path, tiny_data),
         f"cluster.launcher={'slurm' if allocate else 'nope'}", f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=dict(env, **slurm), capture_output=True, text=True, timeout=300)
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


def environment_of(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


@needs_slurm
def test_a_job_step_that_dies_ends_the_slurm_job_within_a_minute(tmp_path, tiny_data, slurm):
    run = tmp_path / "run"
    job = subprocess.Popen(
        ["salloc", "-n", "3", "--quiet", sys.executable, "-m", "kspipe.cli",
         *overrides(tmp_path, tiny_data), "train.meta_iters=100000", "cluster.launcher=slurm",
         f"run_dir={run}"],
        cwd=tmp_path, env=dict(os.environ, **slurm), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        victim = None
        while victim is None:
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.5)
            log = run / "logs" / "worker.1.log"
            if log.is_file() and "meta-train" in log.read_text(errors="replace"):
                victim = next((pid for pid in task_processes(run)
                               if environment_of(pid).get("TRAINING_ROLE") == "TRAINER"
                               and environment_of(pid).get("PADDLE_TRAINER_ID") == "1"), None)
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
    wait_for(lambda: nothing_queued(slurm, 0) and job_processes(run) == [], 60 - took,
             lambda: f"left: {[command_of(p) for p in job_processes(run)]}")


def wait_for(condition, timeout: float, what, poll: float = 0.5) -> None:
    """Wait until ``condition()``; fail with ``what()`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(poll)


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else f"no {path}"


@needs_slurm
def test_a_requeued_slurm_job_continues_from_its_checkpoint_by_itself(tmp_path, tiny_data,
                                                                      slurm):
    """sbatch --requeue; ``scontrol requeue`` after a checkpoint stops the job (its run
    KILLED) and starts it again: it resumes in its own run folder, outputs/job-<id>-..., and
    ends with the weights of a run never interrupted."""
    long = ["train.meta_iters=80", "train.checkpoint_every=4", "train.keep_checkpoints=20",
            "eval.interval=0"]
    job = [*overrides(tmp_path, tiny_data), *long]
    whole = tmp_path / "whole"
    result = subprocess.run([sys.executable, "-m", "kspipe.cli", *job, f"run_dir={whole}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(whole / "checkpoints" / "checkpoint-0000080" / "state.pdparams", "rb") as f:
        expected = pickle.load(f)

    script = tmp_path / "job.sbatch"
    command = " ".join(f"'{a}'" for a in [sys.executable, "-m", "kspipe.cli", *job,
                                          "cluster.launcher=slurm"])
    script.write_text(f"#!/bin/bash\n#SBATCH -n 3\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
                      f"#SBATCH -o {tmp_path}/slurm-%j.out\nexec {command}\n")
    submitted = slurm_command(slurm, "sbatch", "--parsable", f"--chdir={tmp_path}", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    out = tmp_path / f"slurm-{job_id}.out"

    def run_folders():  # outputs/job-<id>-<the command's digest>
        return list((tmp_path / "outputs").glob(f"job-{job_id}-*"))

    wait_for(lambda: any((r / "checkpoints" / "checkpoint-0000008").is_dir()
                         for r in run_folders()), 300, lambda: f"no checkpoint: {tail(out)}")
    (run,) = run_folders()
    assert slurm_command(slurm, "scontrol", "requeue", job_id).returncode == 0
    # Slurm holds a requeued job ~2 minutes (BeginTime); let it go at once
    wait_for(lambda: slurm_command(slurm, "squeue", "-h", "-j", job_id, "-o", "%r").stdout
             .strip() == "BeginTime", 120, lambda: f"the job was not requeued: {tail(out)}")
    slurm_command(slurm, "scontrol", "update", f"JobId={job_id}", "StartTime=now")
    wait_for(lambda: nothing_queued(slurm), 600,
             lambda: f"the requeued job did not finish: {tail(out)}")
    output = out.read_text()
    assert "Slurm requeued the job (restart 1): it resumes from its latest checkpoint" in output
    assert run_folders() == [run]  # the requeued job found its own folder
    # the uninterrupted run's, the job's first (stopped by the requeue) and its second
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED", "FINISHED", "KILLED"], \
        output[-3000:]
    with open(run / "checkpoints" / "checkpoint-0000080" / "state.pdparams", "rb") as f:
        got = pickle.load(f)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@needs_slurm
def test_outside_an_allocation_kspipe_submits_the_job_with_sbatch(tmp_path, tiny_data,
                                                                   launched, slurm):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        [sys.executable, "-m", "kspipe.cli", *overrides(tmp_path, tiny_data),
         "cluster.launcher=slurm", f"run_dir={run}", "cluster.slurm_args=['--job-name=bags']"],
        cwd=tmp_path, env=dict(env, **slurm), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if "submitted Slurm job" in line]
    job = line.split("submitted Slurm job ")[1].split(";")[0]
    assert line == (f"kspipe: submitted Slurm job {job}; follow it with squeue -j {job} and "
                    f"{run / f'slurm-{job}.out'}")
    assert "#SBATCH --job-name=bags" in (run / "kspipe.sbatch").read_text()
    wait_for(lambda: nothing_queued(slurm), 600,
             lambda: f"the job did not finish: {tail(run / f'slurm-{job}.out')}")
    got = final_weights(run)
    for name, value in launched.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"], tail(run / f"slurm-{job}.out")


@needs_slurm
def test_a_sweep_runs_each_job_as_a_slurm_job_with_submitit(tmp_path, tiny_data, launched,
                                                            slurm):
    """``kspipe -m hydra/launcher=submitit_slurm``: each job of the sweep is a Slurm job
    (hydra-submitit-launcher's), the parent and child runs are a local sweep's, and the
    workers=2 job trains what kspipe's own launcher does, bit for bit."""
    sweep = tmp_path / "sweep"
    job = [o for o in overrides(tmp_path, tiny_data) if not o.startswith("workers=")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        [sys.executable, "-m", "kspipe.cli", "-m", "hydra/launcher=submitit_slurm",
         "hydra.launcher.mem_gb=null", *job, "workers=1,2", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=dict(env, **slurm), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kspipe: best: workers=" in result.stderr
    logs = sorted((sweep / ".submitit").glob("*_*/*_log.out"))  # <Slurm job>_<task>
    assert len(logs) == 2
    for log in logs:
        assert "kspipe: done: test_accuracy" in log.read_text(), tail(log)
    # the sweep's parent and its two jobs
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"] * 3
    got = final_weights(sweep / "1")  # workers=2
    for name, value in launched.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert nothing_queued(slurm)


@needs_slurm
def test_a_collective_job_in_a_slurm_allocation_trains_what_the_launcher_does(
        tmp_path, tiny_data, slurm):
    job = ["+experiment=omniglot_5way", f"train.meta_iters={ITERATIONS}",
           *[o for o in tiny_overrides(tmp_path, tiny_data) if not o.startswith("run_dir=")],
           "mode=collective", "workers=2"]
    weights = {}
    for name, command in (("processes", []), ("slurm", ["salloc", "-n", "2", "--quiet"])):
        run = tmp_path / name
        result = subprocess.run(
            [*command, sys.executable, "-m", "kspipe.cli", *job, f"cluster.launcher={name}",
             f"run_dir={run}"], cwd=tmp_path, env=dict(os.environ, **slurm),
            capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        weights[name] = final_weights(run)
    for name, value in weights["processes"].items():
        np.testing.assert_array_equal(weights["slurm"][name], value, err_msg=name)
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED", "FINISHED"]
    assert nothing_queued(slurm)



# --- Kubernetes: a PaddleJob ---------------------------------------------------------

#: paddle-operator's constants (controllers/paddlejob_controller.go): every pod's port, and
#: how many it may use (gloo's HTTP store is on the first server's port + 18)
OPERATOR_PORT, OPERATOR_PORTS = 36000, 20


def operator_environments(job: dict) -> list[tuple[str, dict]]:
    """Each pod of ``job`` (a PaddleJob) with the environment paddle-operator gives it
    (its ConfigMap, POD_IP, PADDLE_TRAINER_ID, TRAINING_ROLE), pod IPs on loopback."""
    spec = job["spec"]
    kinds = [("ps", "PSERVER"), ("worker", "TRAINER")]
    pods, address = [], 2
    for kind, role in kinds:
        for index in range(spec[kind]["replicas"] if kind in spec else 0):
            pods.append((kind, index, role, f"127.0.0.{address}"))
            address += 1
    servers = [f"{ip}:{OPERATOR_PORT}" for kind, _, _, ip in pods if kind == "ps"]
    workers = [f"{ip}:{OPERATOR_PORT}" for kind, _, _, ip in pods if kind == "worker"]
    config_map = {"TRAINER_PORTS_NUM": str(OPERATOR_PORTS), "PADDLE_PORT": str(OPERATOR_PORT),
                  "PADDLE_TRAINER_ENDPOINTS": ",".join(workers),
                  "PADDLE_TRAINERS": ",".join(w.rpartition(":")[0] for w in workers),
                  "PADDLE_TRAINERS_NUM": str(len(workers))}
    if servers:
        config_map["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(servers)
        if spec.get("withGloo", 0) > 0:
            host = servers[0].rpartition(":")[0]
            config_map.update(PADDLE_WITH_GLOO=str(spec["withGloo"]), PADDLE_GLOO_RENDEZVOUS="3",
                              PADDLE_GLOO_HTTP_ENDPOINT=f"{host}:{OPERATOR_PORT + OPERATOR_PORTS - 2}")
    out = []
    for kind, index, role, ip in pods:
        (container,) = spec[kind]["template"]["spec"]["containers"]
        env = {**config_map, "POD_IP": ip, "PADDLE_TRAINER_ID": str(index),
               "TRAINING_ROLE": role, "PADDLE_TRAINING_ROLE": role,
               **{e["name"]: e["value"] for e in container.get("env", [])}}
        out.append((f"{kind}-{index}", {"command": container["command"], "env": env}))
    return out


def test_a_paddlejob_manifest_runs_as_one_job_from_the_operators_environment(
        tmp_path, tiny_data, launched):
    import yaml

    wrote = subprocess.run(
        [sys.executable, "-m", "kspipe.cli", *overrides(tmp_path, tiny_data),
         "cluster.launcher=paddlejob", "cluster.image=registry.example/kspipe:1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    (line,) = [line for line in wrote.stdout.splitlines() if "PaddleJob" in line]
    path = Path(line.split("kubectl apply -f ")[1])
    assert line == f"kspipe: wrote the PaddleJob {path}; start it with kubectl apply -f {path}"
    job = yaml.safe_load(path.read_text())
    assert (job["apiVersion"], job["kind"]) == ("batch.paddlepaddle.org/v1", "PaddleJob")
    assert (job["spec"]["ps"]["replicas"], job["spec"]["worker"]["replicas"]) == (1, 2)
    assert run_statuses(tmp_path / "mlflow.db") == []

    pods = []
    try:
        for name, pod in operator_environments(job):
            command = pod["command"]
            assert command[0] == "kspipe"
            pods.append(subprocess.Popen(
                [sys.executable, "-m", "kspipe.cli", *command[1:]], cwd=tmp_path,
                env=dict(os.environ, **pod["env"], **THREADS), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
            time.sleep(1.0)  # pods start when Kubernetes gets to them
        outputs = [p.communicate(timeout=300)[0] for p in pods]
    finally:
        for p in pods:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in pods] == [0, 0, 0], outputs[-1][-3000:]
    folder = tmp_path / "outputs" / f"job-{job['metadata']['name']}"
    got = final_weights(folder)
    for name, value in launched.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
