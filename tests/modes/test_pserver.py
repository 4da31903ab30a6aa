"""mode=pserver on real fleet clusters on loopback: failures stop the job cleanly, endpoint
lists work, and bad cluster settings give one clear line (the exchanges: test_exchange.py;
learning: workloads/test_learning.py)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from kspipe.cluster.endpoints import free_ports
from kspipe.errors import ConfigError
from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager, run_kspipe, run_statuses, tiny_overrides
from tests.kit import job_processes


def worker_pid(run_dir, index):
    for pid in job_processes(run_dir):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"TRAINING_ROLE=PSERVER" not in env and f"PADDLE_TRAINER_ID={index}".encode() in env:
            return int(pid)
    return None


@pytest.mark.parametrize("mode", ["pserver", "collective"])
def test_a_killed_worker_stops_the_job(tmp_path, tiny_data, mode):
    run_dir = tmp_path / "run"
    args = [
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, tiny_data),
        f"mode={mode}",
        "workers=2",
        "servers=1",
        "train.meta_iters=100000",
        "train.checkpoint_every=0",
        "eval.interval=0",
    ]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kspipe.cli.command", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        log = run_dir / "logs" / "worker.1.log"
        while time.monotonic() < deadline:  # wait until worker 1 trains
            if log.exists() and "meta-train" in log.read_text(errors="replace"):
                break
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.5)
        pid = worker_pid(run_dir, 1)
        assert pid
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0 and took < 30
    assert "Traceback" not in stderr
    assert f"kspipe: error: worker 1 was killed by SIGKILL; its log: {log}" in stderr
    assert not job_processes(run_dir)
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (record,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    assert len(client.list_artifacts(record.info.run_id, "logs")) == (3 if mode == "pserver" else 2)


def test_explicit_endpoint_lists_on_loopback(tmp_path, tiny_data):
    """Both syntaxes of an endpoint list in one job: the servers in Hydra's list syntax,
    the workers as a quoted string."""
    s0, s1, w0, w1 = free_ports(4)
    cfg = compose_config(
        [
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "mode=pserver",
            f"servers=[127.0.0.1:{s0},127.0.0.1:{s1}]",
            f"workers='127.0.0.1:{w0},127.0.0.1:{w1}'",
            "cluster.strategy=sync",
        ]
    )
    metrics = run(cfg, plugin_manager())
    assert 0 <= metrics["test_accuracy"] <= 1 and "worker1/tasks_per_s" in metrics
    logs = tmp_path / "run" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [
        "server.0.log",
        "server.1.log",
        "worker.0.log",
        "worker.1.log",
    ]
    assert "meta-train" in (logs / "worker.1.log").read_text()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.strategy=half_async"], "has no half-async mode"),
        (["cluster.strategy=ring"], "cluster.strategy='ring' is not one of"),
        (["cluster.strategy=geo", "cluster.k_steps=0"], "cluster.k_steps=0 must be at least 1"),
        (["servers=0"], "servers=0 must be at least 1"),
        (["servers=localhost"], "'localhost' is not host:port"),
        (["workers='127.0.0.1:7001,127.0.0.1:7001'"], "an endpoint appears twice"),
        (["servers=10.0.0.1:7000", "workers=10.0.0.2:7001"], "set cluster.host"),
        (["workers=abc"], "workers: 'abc' is not host:port"),
        (["mode=local", "workers=abc"], "workers: 'abc' is not host:port"),
        (["mode=local", "workers=0"], "workers=0 must be at least 1"),
        (["mode=collective", "servers=1.5"], "servers=1.5 must be an integer"),
        (
            [
                "servers=[10.0.0.1:7000]",
                "workers=[10.0.0.1:7001,10.0.0.2:7001]",
                "cluster.host=10.0.0.1",
                "cluster.control_port=7001",
            ],
            "control endpoint 10.0.0.1:7001",
        ),
    ],
)
def test_bad_cluster_settings(tmp_path, tiny_data, overrides, message):
    cfg = compose_config(
        [
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "mode=pserver",
            *overrides,
        ]
    )
    with pytest.raises(ConfigError, match=message):
        run(cfg, plugin_manager())


def test_a_port_in_use_is_named(tmp_path, tiny_data):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        cfg = compose_config(
            [
                "+experiment=omniglot_5way",
                *tiny_overrides(tmp_path, tiny_data),
                "mode=pserver",
                f"servers=127.0.0.1:{port}",
            ]
        )
        with pytest.raises(ConfigError, match=f"port 127.0.0.1:{port} is not free"):
            run(cfg, plugin_manager())
    finally:
        busy.close()


def test_local_mode_says_it_ignores_a_worker_count(tmp_path, tiny_data, capsys):
    cfg = compose_config(
        [
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "workers=4",
            "train.meta_iters=1",
            "eval.baseline=false",
        ]
    )
    run(cfg, plugin_manager())
    assert "kspipe: workers=4 is ignored: mode=local runs one process" in capsys.readouterr().err


def test_an_async_checkpoint_holds_the_servers_parameters(tmp_path, tiny_data):
    """Async workers pull at their own times; before a checkpoint every push is in and each
    worker takes the servers' parameters, so all workers save the same model mid-run."""
    import pickle

    import numpy as np

    run_dir = tmp_path / "run"
    result = run_kspipe(
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, tiny_data),
        "mode=pserver",
        "workers=2",
        "cluster.strategy=async",
        "train.meta_iters=8",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=3",
        "eval.interval=0",
        "eval.baseline=false",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for step in (4, 8):
        name = f"checkpoint-{step:07d}/state.pdparams"
        first = pickle.loads((run_dir / "checkpoints" / name).read_bytes())
        other = pickle.loads((run_dir / "checkpoints" / "worker-1" / name).read_bytes())
        assert sorted(first) == sorted(other)
        # batch norm's running statistics are each worker's own: not exchanged
        exchanged = [k for k in first if not k.endswith((".mean", ".var"))]
        assert len(exchanged) >= 10
        for key in exchanged:
            np.testing.assert_array_equal(first[key], other[key])
