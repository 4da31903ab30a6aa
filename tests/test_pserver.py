"""mode=pserver on real fleet clusters on loopback: each strategy trains, failures stop the
job cleanly, and bad cluster settings give one clear line."""

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from kspipe.modes.launch import free_ports
from kspipe.errors import ConfigError
from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager, tiny_omniglot, tiny_overrides


@pytest.fixture(scope="module")
def data60(tmp_path_factory):
    return tiny_omniglot(tmp_path_factory.mktemp("kanji60"), characters=60, drawers=8)


def learning_cfg(tmp_path, data, *overrides):
    return compose_config([
        "+experiment=omniglot_5way", f"dataset.root={data}", "dataset.train_characters=40",
        f"run_dir={tmp_path / 'run'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "model.filters=32", "task.shots=1", "train.shots=5", "train.meta_iters=300",
        "eval.tasks=60", "eval.inner_iters=20", "eval.interval=0", "seed=0",
        "mode=pserver", "workers=2", "servers=1", "cluster.timeout_s=300", *overrides])


# async interleaves the two workers by timing, so its result varies from run to run
@pytest.mark.parametrize("strategy, margin", [("async", 0.05), ("sync", 0.03), ("geo", 0.03)])
def test_strategy_trains_reptile_on_a_cluster(tmp_path, data60, strategy, margin):
    cfg = learning_cfg(tmp_path, data60, f"cluster.strategy={strategy}")
    metrics = run(cfg, plugin_manager())
    assert metrics["test_accuracy"] >= metrics["baseline_test_accuracy"] + margin, metrics
    assert metrics["worker0/tasks_per_s"] > 0 and metrics["worker1/tasks_per_s"] > 0

    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    (record,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    assert record.info.status == "FINISHED"
    assert record.data.metrics["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
    assert record.data.params["cluster.strategy"] == strategy
    logs = {a.path for a in client.list_artifacts(record.info.run_id, "logs")}
    assert logs == {"logs/server.0.log", "logs/worker.0.log", "logs/worker.1.log"}
    assert "inference_model" in {a.path for a in client.list_artifacts(record.info.run_id)}
    assert not leftover_processes(cfg.run_dir)


def leftover_processes(run_dir):
    out = subprocess.run(["pgrep", "-f", f"kspipe.worker {run_dir}"], capture_output=True,
                         text=True).stdout.split()
    return [pid for pid in out if int(pid) != os.getpid()]


def worker_pid(run_dir, index):
    for pid in leftover_processes(run_dir):
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
    args = ["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data),
            f"mode={mode}", "workers=2", "servers=1", "train.meta_iters=100000",
            "train.checkpoint_every=0", "eval.interval=0"]
    launcher = subprocess.Popen([sys.executable, "-m", "kspipe.cli", *args], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    assert not leftover_processes(run_dir)
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("select status from runs").fetchall() == [("FAILED",)]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (record,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    assert len(client.list_artifacts(record.info.run_id, "logs")) == (3 if mode == "pserver" else 2)


def test_explicit_endpoint_lists_on_loopback(tmp_path, tiny_data):
    s, w0, w1 = free_ports(3)
    cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data),
                          "mode=pserver", f"servers=127.0.0.1:{s}",
                          f"workers='127.0.0.1:{w0},127.0.0.1:{w1}'", "cluster.strategy=sync"])
    metrics = run(cfg, plugin_manager())
    assert 0 <= metrics["test_accuracy"] <= 1 and "worker1/tasks_per_s" in metrics
    job = (tmp_path / "run" / "logs" / "worker.1.log").read_text()
    assert "meta-train" in job


@pytest.mark.parametrize("overrides, message", [
    (["cluster.strategy=half_async"], "has no half-async mode"),
    (["cluster.strategy=ring"], "cluster.strategy='ring' is not one of"),
    (["cluster.strategy=geo", "cluster.k_steps=0"], "cluster.k_steps=0 must be at least 1"),
    (["servers=0"], "servers=0 must be at least 1"),
    (["servers=localhost"], "'localhost' is not host:port"),
    (["workers='127.0.0.1:7001,127.0.0.1:7001'"], "an endpoint appears twice"),
    (["servers=10.0.0.1:7000", "workers=10.0.0.2:7001"], "set cluster.host"),
])
def test_bad_cluster_settings(tmp_path, tiny_data, overrides, message):
    cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data),
                          "mode=pserver", *overrides])
    with pytest.raises(ConfigError, match=message):
        run(cfg, plugin_manager())


def test_a_port_in_use_is_named(tmp_path, tiny_data):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data),
                              "mode=pserver", f"servers=127.0.0.1:{port}"])
        with pytest.raises(ConfigError, match=f"port 127.0.0.1:{port} is not free"):
            run(cfg, plugin_manager())
    finally:
        busy.close()
