"""Sweeps from the command line: a parent run with a child per job and their comparison,
a failing job, the MLflow UI over the runs, a sweep of the ctr workload.  (The plugin
listing and an installed plugin package: registry/test_entry_points.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from kspipe.cluster.endpoints import free_ports
from kspipe.testing import run_kspipe, tiny_overrides
from tests.kit import stopped_when


def sweep_args(tmp_path, data):
    return [
        "+experiment=omniglot_5way",
        *[o for o in tiny_overrides(tmp_path, data) if not o.startswith("run_dir=")],
    ]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_data):
    """A two-job sweep (workers=1 and 2 on a parameter-server cluster) and a failing one."""
    tmp = tmp_path_factory.mktemp("sweep")
    ok = run_kspipe("-m", *sweep_args(tmp, tiny_data), "mode=pserver", "workers=1,2", cwd=tmp)
    bad = run_kspipe("-m", *sweep_args(tmp, tiny_data), "task.ways=3,30", cwd=tmp)
    return tmp, ok, bad


def runs(tmp):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    found = client.search_runs(
        [client.get_experiment_by_name("kspipe").experiment_id],
        order_by=["attributes.start_time ASC"],
    )
    return client, found


def test_a_sweep_has_a_parent_run_with_a_child_per_job(sweep):
    tmp, ok, _ = sweep
    assert ok.returncode == 0, ok.stderr[-2000:]
    client, found = runs(tmp)
    parents = [r for r in found if r.data.tags.get("kspipe.sweep") == "parent"]
    first = parents[0]
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == first.info.run_id]
    assert first.info.status == "FINISHED" and len(children) == 2
    assert sorted(c.data.params["workers"] for c in children) == ["1", "2"]
    assert all(c.info.status == "FINISHED" and "test_accuracy" in c.data.metrics for c in children)
    assert {c.data.tags["kspipe.workload"] for c in children} == {"reptile"}
    assert first.data.tags["kspipe.workload"] == "reptile"
    assert all(
        {"config.yaml", "logs", "inference_model"}
        <= {a.path for a in client.list_artifacts(c.info.run_id)}
        for c in children
    )
    assert {"comparison.csv", "comparison.png"} <= {
        a.path for a in client.list_artifacts(first.info.run_id)
    }
    table = Path(
        client.download_artifacts(first.info.run_id, "comparison.csv", str(tmp))
    ).read_text()
    assert "workers=1" in table and "workers=2" in table
    header = table.splitlines()[0].split(",")  # the metrics the Reptile workload declares
    assert header[4:] == [
        "test_accuracy",
        "test_accuracy_ci95",
        "baseline_test_accuracy",
        "train_accuracy",
        "tasks_per_s",
    ]


def test_a_failing_job_fails_its_child_and_the_parent_but_not_the_others(sweep):
    tmp, _, bad = sweep
    assert bad.returncode != 0
    assert "kspipe: error: job task.ways=30: task.ways=30 is more than" in bad.stderr
    assert "kspipe: error: 1 job(s) of the sweep failed" in bad.stderr
    assert "Traceback" not in bad.stderr
    _, found = runs(tmp)
    parent = [r for r in found if r.data.tags.get("kspipe.sweep") == "parent"][-1]
    children = {
        c.data.params["task.ways"]: c.info.status
        for c in found
        if c.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert parent.info.status == "FAILED"
    assert children == {"3": "FINISHED", "30": "FAILED"}
    (failed,) = [c for c in found if c.info.status == "FAILED" and c is not parent]
    assert failed.data.tags["kspipe.error"].startswith("task.ways=30 is more than")


def test_a_sweep_stopped_mid_job_ends_its_parent_run_killed_not_running(tmp_path, tiny_data):
    """Ctrl-C in a sweep's first job: the job stops at a safe point (KILLED), and so does
    the sweep, whose parent run Hydra would leave RUNNING (it calls no callback then)."""
    sweep_dir = tmp_path / "multi"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "-m",
            *sweep_args(tmp_path, tiny_data),
            "task.ways=3,4",
            "train.meta_iters=100000",
            "train.checkpoint_every=2",
            "eval.interval=0",
            "eval.baseline=false",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = stopped_when(job, lambda: list(sweep_dir.glob("0/checkpoints/checkpoint-*")), 120)
    assert job.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr, stderr
    _, found = runs(tmp_path)
    statuses = {r.data.tags.get("kspipe.sweep", "job"): r.info.status for r in found}
    assert statuses == {"parent": "KILLED", "job": "KILLED"}, statuses
    assert not (sweep_dir / "1").exists()  # the sweep stopped: no second job


def test_the_mlflow_ui_serves_the_sweep(sweep):
    tmp, _, _ = sweep
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "ui",
            "--backend-store-uri",
            f"sqlite:///{tmp / 'mlflow.db'}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=dict(os.environ, TMPDIR=str(tmp)),
    )  # its lock files
    base = f"http://127.0.0.1:{port}/api/2.0/mlflow"

    def call(path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            base + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                experiment = call("/experiments/get-by-name?experiment_name=kspipe")["experiment"]
                break
            except OSError:
                assert time.monotonic() < deadline, "the MLflow server did not start"
                time.sleep(1)
        found = call(
            "/runs/search",
            {
                "experiment_ids": [experiment["experiment_id"]],
                "filter": "tags.kspipe.sweep = 'parent' and attributes.status = 'FINISHED'",
            },
        )["runs"]
        parent = found[0]["info"]["run_id"]
        children = call(
            "/runs/search",
            {
                "experiment_ids": [experiment["experiment_id"]],
                "filter": f"tags.mlflow.parentRunId = '{parent}'",
            },
        )["runs"]
        assert len(children) == 2
        child = children[0]["info"]["run_id"]
        history = call(f"/metrics/get-history?run_id={child}&metric_key=test_accuracy")
        assert 0 <= history["metrics"][-1]["value"] <= 1
        files = {f["path"] for f in call(f"/artifacts/list?run_id={parent}")["files"]}
        assert "comparison.png" in files
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def test_a_sweep_of_the_ctr_workload_compares_auc_and_samples_per_s(tmp_path):
    result = run_kspipe(
        "-m",
        "+experiment=ctr_datafeed",
        "datafeed.threads=1,2",
        "ctr.epochs=1",
        "datafeed.generated.lines_per_file=500",
        f"datafeed.generated.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    client, found = runs(tmp_path)
    (parent,) = [r for r in found if r.data.tags.get("kspipe.sweep") == "parent"]
    table = Path(client.download_artifacts(parent.info.run_id, "comparison.csv", str(tmp_path)))
    rows = table.read_text().splitlines()
    header = rows[0].split(",")
    assert len(rows) == 3 and "test_auc" in header and "samples_per_s" in header
    assert "test_accuracy" not in header and "tasks_per_s" not in header
    assert parent.data.tags["kspipe.workload"] == "ctr"
    for row in rows[1:]:
        values = dict(zip(header, row.split(",")))
        assert values["job"].startswith("datafeed.threads=")
        assert 0 < float(values["test_auc"]) <= 1 and float(values["samples_per_s"]) > 0
    assert "comparison.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
