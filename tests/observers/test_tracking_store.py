"""The MLflow store: jobs started together on one new SQLite store all finish and are all
recorded (one of them creates the store, under a lock), a store that cannot be opened
is one line before anything runs, and a job killed outright leaves no run RUNNING."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kspipe.errors import ConfigError
from kspipe.observers.mlflow import store, sweep_runs
from kspipe.testing import Server, begun_store, run_kspipe, run_statuses, tiny_overrides

#: The smallest run: one meta-iteration, two evaluation tasks, no baseline.
QUICK = [
    "train.meta_iters=1",
    "train.inner_iters=1",
    "eval.tasks=2",
    "eval.train_tasks=2",
    "eval.inner_iters=1",
    "eval.baseline=false",
]


def job_args(tmp_path, data, *extra):
    """``kspipe`` arguments of a quick run whose store is the default one (``mlflow.db`` in
    the folder it starts in), with ``extra`` last."""
    tiny = [
        o for o in tiny_overrides(tmp_path, data) if not o.startswith(("run_dir=", "tracking.uri="))
    ]
    (tmp_path / "mlflow.db").unlink()  # tiny_overrides began it: the default store is new
    return [
        sys.executable,
        "-m",
        "kspipe.cli.command",
        "+experiment=omniglot_5way",
        *tiny,
        *QUICK,
        *extra,
    ]


def test_jobs_started_together_on_a_new_store_all_finish_and_are_recorded(tmp_path, tiny_data):
    jobs = [
        subprocess.Popen(
            job_args(tmp_path, tiny_data, f"run_dir={tmp_path / f'run{i}'}"),
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(4)
    ]
    results = [(job.wait(timeout=300), *job.communicate()) for job in jobs]
    for code, _, err in results:
        assert code == 0, err
        assert "Traceback" not in err
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"] * 4
    assert not [name for name in os.listdir(tmp_path) if "lock" in name]  # the folder was locked


def test_the_store_lock_excludes_a_second_holder(tmp_path):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    probe = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
        "    sys.exit(1)\n"
    )
    with store.store_lock(uri):
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "store")])
    free = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "store")])
    assert (held.returncode, free.returncode) == (1, 0)
    assert os.listdir(tmp_path / "store") == []


@pytest.mark.parametrize(
    "uri, damage, fragment",
    [
        ("sqlite:////proc/kspipe/mlflow.db", None, "No such file or directory"),
        ("sqlite:///{tmp}/store.db", b"this is no database", "file is not a database"),
        # MLflow alone retries a server that is not there for about four minutes
        (
            "http://127.0.0.1:{port}",
            None,
            "no server answers there ([Errno 111] Connection refused)",
        ),
    ],
)
def test_a_store_that_cannot_be_opened_is_one_line_before_training(
    tmp_path, tiny_data, uri, damage, fragment
):
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    uri = uri.format(tmp=tmp_path, port=port)
    if damage:
        (tmp_path / "store.db").write_bytes(damage)
    result = subprocess.run(
        job_args(tmp_path, tiny_data, f"run_dir={tmp_path / 'run'}", f"tracking.uri={uri}"),
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(
        f"kspipe: error: tracking.uri={uri}: cannot open the MLflow store: "
    )
    assert fragment in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before training


def tracking_server(tmp_path):
    """``mlflow server`` on loopback, its store ``server.db`` in ``tmp_path``."""
    return Server(
        [
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--default-artifact-root",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        "/health",
        tmp_path,
    )


def test_a_job_records_its_run_on_a_tracking_server(tmp_path, tiny_data):
    """``tracking.uri=http://...``: the run is made on the server (found in the server's
    own store), and its page is the server's, not an ``mlflow ui`` to start."""
    server = tracking_server(tmp_path)
    try:
        url = server.ready()
        result = subprocess.run(
            job_args(tmp_path, tiny_data, f"run_dir={tmp_path / 'run'}", f"tracking.uri={url}"),
            cwd=tmp_path,
            text=True,
            capture_output=True,
            timeout=300,
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_statuses(tmp_path / "server.db") == ["FINISHED"]
    assert not (tmp_path / "mlflow.db").exists()
    (page,) = [line for line in result.stderr.splitlines() if line.startswith("kspipe: runs: ")]
    assert page.startswith(f"kspipe: runs: {url}/#/experiments/") and "mlflow ui" not in page


def test_a_tracking_server_that_stops_answering_mid_run_ends_the_job_in_one_line(
    tmp_path, tiny_data
):
    """The server is killed once the run is made there: the job trains on, keeps its
    results in its run folder, and ends in one line within a bounded time (MLflow's own
    retries would hold each of its requests for about four minutes)."""
    server = tracking_server(tmp_path)
    job = None
    try:
        url = server.ready()
        job = subprocess.Popen(
            job_args(
                tmp_path,
                tiny_data,
                f"run_dir={tmp_path / 'run'}",
                f"tracking.uri={url}",
                "train.meta_iters=100",
            ),
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        seen = []
        for line in job.stdout:  # the run is made on the server before training starts
            seen.append(line)
            if line.startswith("meta-train 1/"):
                break
        assert run_statuses(tmp_path / "server.db") == ["RUNNING"], "".join(seen)
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        out, _ = job.communicate(timeout=240)
    finally:
        if server.process.poll() is None:
            server.stop()
        if job is not None:
            job.kill()
    out = "".join(seen) + out
    assert job.returncode != 0 and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("kspipe: error:")]
    assert errors == [
        f"kspipe: error: tracking.uri={url}: the MLflow server stopped answering; "
        "the run was not ended there (it shows RUNNING); this run's folder "
        "holds its results"
    ], out
    assert f"kspipe: the MLflow server at {url} stopped answering" in out
    assert (tmp_path / "run" / "metrics.json").is_file()  # trained to the end, results kept
    assert (tmp_path / "run" / "learning_curve.png").is_file()


def test_a_stores_artifacts_are_beside_it_not_in_the_folder_a_job_started_in(tmp_path, tiny_data):
    """MLflow puts a new experiment's artifacts in ``./mlruns`` of the folder the job that
    made it ran in, wherever the store is; kspipe puts them beside a SQLite store."""
    project = tmp_path / "project"
    project.mkdir()
    uri = begun_store(tmp_path / "store")
    tiny = [
        o
        for o in tiny_overrides(tmp_path, tiny_data)
        if not o.startswith(("run_dir=", "tracking.uri="))
    ]
    result = run_kspipe(
        "+experiment=omniglot_5way",
        *tiny,
        *QUICK,
        f"tracking.uri={uri}",
        f"run_dir={project / 'run'}",
        cwd=project,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(project)) == ["run"]
    configs = list((tmp_path / "store" / "mlruns").glob("*/*/artifacts/config.yaml"))
    assert len(configs) == 1, list((tmp_path / "store").rglob("*"))


def test_a_sweeps_parent_run_opens_the_store_the_same_way(tmp_path):
    cfg = OmegaConf.create(
        {"tracking": {"uri": "sqlite:////proc/kspipe/mlflow.db", "experiment": "kspipe"}}
    )
    with pytest.raises(ConfigError, match="cannot open the MLflow store"):
        sweep_runs.start_parent_run(cfg, "sweep", {})
    assert sweep_runs.PARENT_RUN_ENV not in os.environ


def test_a_job_killed_outright_ends_its_run_failed_and_leaves_no_process(tmp_path, tiny_data):
    """SIGKILL runs no handler in the job's process: the recorder sees its pipe close, ends
    the run FAILED and exits."""
    mark = uuid.uuid4().hex
    job = subprocess.Popen(
        job_args(tmp_path, tiny_data, f"run_dir={tmp_path / 'run'}", "train.meta_iters=100000"),
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, KSPIPE_TEST_MARK=mark),
    )
    try:
        for line in job.stdout:
            if line.startswith("meta-train"):
                break
        assert run_statuses(tmp_path / "mlflow.db") == ["RUNNING"]
        assert processes_marked(mark) != [job.pid]  # the recorder runs beside the job
    finally:
        job.kill()
        job.wait()
    deadline = time.time() + 60
    while processes_marked(mark) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_marked(mark) == []
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]


def processes_marked(mark: str) -> list[int]:
    """The processes whose environment holds ``KSPIPE_TEST_MARK=mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"KSPIPE_TEST_MARK={mark}".encode() in (
                entry / "environ"
            ).read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(found)


@pytest.mark.parametrize(
    "setting, composing, recorded",
    [
        ({}, True, True),
        ({"tracking.enabled": "false"}, False, False),
        # the config turns tracking off, not the command line: started, then ended
        ({"tracking.enabled": "${oc.decode:'false'}"}, True, False),
        ({"env": ("TRAINING_ROLE", "PSERVER")}, False, False),
    ],
    ids=["tracked", "untracked", "untracked by the config", "a role"],
)
def test_the_command_starts_its_recorder_before_paddles_import(
    tmp_path, tiny_data, monkeypatch, setting, composing, recorded
):
    """MLflow's import (2-4 s) runs beside the config's composition and Paddle's import:
    the recorder the run will take is started before the config is composed, and is there
    when ``stopping.install`` imports Paddle.  Not for a run that records nothing, nor in
    a process a scheduler started as a role (its first worker records)."""
    from kspipe.cli import command as cli
    from kspipe.observers.mlflow import recorder
    from kspipe.process import stopping

    if "env" in setting:
        monkeypatch.setenv(*setting["env"])
    started, at_composing = [], []

    def install():  # where the command would import Paddle: stop there
        started.append(recorder._early)
        raise SystemExit(0)

    def check_config(*args, **kwargs):
        at_composing.append(recorder._early)
        return compose(*args, **kwargs)

    compose = cli.check_config
    monkeypatch.setattr(cli, "check_config", check_config)
    # this test's process keeps its environment (the command's set-up: test_memory.py)
    monkeypatch.setattr(cli, "prepare_process", lambda role: None)
    monkeypatch.setattr(stopping, "install", install)
    args = tiny_overrides(tmp_path, tiny_data) + [
        f"{k}={v}" for k, v in setting.items() if k != "env"
    ]
    monkeypatch.setattr(sys, "argv", ["kspipe", "+experiment=omniglot_5way", *args])
    try:
        with pytest.raises(SystemExit):
            cli.main()
        early = started[0]
        assert (at_composing[0] is not None) == composing
        assert (early is not None) == recorded
        if composing and not recorded:  # ended, not left importing MLflow
            assert at_composing[0].process.poll() is not None
        if recorded:
            assert early.process.poll() is None  # importing MLflow, or waiting for the run
            assert recorder.Recorder.take() is early and recorder._early is None
    finally:
        if started and started[0] is not None:
            started[0].close()
        recorder.end_early()


def test_a_recorder_started_early_that_died_is_replaced(monkeypatch):
    from kspipe.observers.mlflow import recorder

    dead = recorder.Recorder.start()
    dead.process.kill()
    dead.process.wait()
    monkeypatch.setattr(recorder, "_early", dead)
    taken = recorder.Recorder.take()
    try:
        assert taken is not dead and taken.process.poll() is None
        assert recorder._early is None
    finally:
        taken.close()


def test_a_recorder_started_early_that_died_before_its_store_was_known_is_ended():
    """Told where the store is, a recorder that died meanwhile is ended (the run starts
    another): no broken pipe for the command."""
    from kspipe.observers.mlflow import recorder

    recorder.start_early()
    early = recorder._early
    early.process.kill()
    early.process.wait()
    recorder.prepare_early("sqlite:///nowhere.db")
    assert recorder._early is None


def test_a_recorder_no_run_took_ends_with_the_command(tmp_path, tiny_data):
    """A job that stops before its run begins (here a range the workload refuses) leaves
    no recorder behind, still importing MLflow and holding the command's output open."""
    mark = uuid.uuid4().hex
    with open(tmp_path / "out.txt", "w") as out:
        job = subprocess.run(
            job_args(tmp_path, tiny_data, "train.replacement=true", "train.inner_batch=1000"),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
            env=dict(os.environ, KSPIPE_TEST_MARK=mark),
        )
    assert job.returncode != 0
    assert "train.inner_batch=1000" in (tmp_path / "out.txt").read_text()
    assert processes_marked(mark) == []
    assert run_statuses(tmp_path / "mlflow.db") == []
