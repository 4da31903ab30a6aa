"""A command given no run folder gets one of its own, named by the time: two commands
started in the same second never share one (their checkpoints and metrics would
overwrite each other's); a command refused before its job started leaves none."""

import os
import subprocess
import sys
import time
from datetime import datetime, timedelta

from mlflow import MlflowClient

from kspipe.testing import (
    assert_one_line_error,
    begun_store,
    run_kspipe,
    run_statuses,
    tiny_overrides,
)


def test_processes_asking_at_once_for_one_name_each_get_a_folder(tmp_path):
    name = "outputs/2026-01-01/10-00-00"
    go = tmp_path / "go"
    ask = (
        "import os, sys, time\n"
        "from kspipe.job import new_folder\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
        f"first = new_folder({name!r})\n"
        f"assert new_folder({name!r}) == first  # once a process has one, it keeps it\n"
        "print(first)\n"
    )
    asking = [
        subprocess.Popen(
            [sys.executable, "-c", ask], cwd=tmp_path, text=True, stdout=subprocess.PIPE
        )
        for _ in range(4)
    ]
    time.sleep(1)  # every process waiting
    go.touch()
    got = sorted(p.communicate(timeout=60)[0].strip() for p in asking)
    assert [p.returncode for p in asking] == [0] * 4
    assert got == [name, f"{name}-2", f"{name}-3", f"{name}-4"]
    assert all((tmp_path / folder).is_dir() for folder in got)


def test_a_command_whose_time_is_taken_runs_in_a_folder_of_its_own(tmp_path, tiny_data):
    """Every folder the command could be named for (the next five minutes') is taken, as
    by another command started in the same second: it runs in ``<time>-2``, and leaves the
    taken ones as they were."""
    start = datetime.now()
    taken = set()
    for second in range(300):
        moment = start + timedelta(seconds=second)
        folder = tmp_path / "outputs" / moment.strftime("%Y-%m-%d") / moment.strftime("%H-%M-%S")
        folder.mkdir(parents=True, exist_ok=True)
        taken.add(folder)
    args = [a for a in tiny_overrides(tmp_path, tiny_data) if not a.startswith("run_dir=")]
    result = run_kspipe(
        "+experiment=omniglot_5way",
        *args,
        "train.meta_iters=1",
        "eval.tasks=2",
        "eval.train_tasks=2",
        "eval.baseline=false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = result.stdout.strip().splitlines()[-1]
    run = done.rpartition("(run folder ")[2].rstrip(")")
    assert run.endswith("-2") and os.path.isdir(run) and (tmp_path / run / "metrics.json").is_file()
    assert run[:-2] in {str(folder) for folder in taken}
    assert all(not any(folder.iterdir()) for folder in taken)


def test_a_refused_job_leaves_no_empty_jobs_log(tmp_path):
    """Hydra's job log (``jobs.log``) stayed empty in every run folder: kspipe says what it
    has to on the console, so Hydra writes none."""
    result = run_kspipe(
        "+experiment=omniglot_5way", f"dataset.root={tmp_path / 'missing'}", cwd=tmp_path
    )
    assert "does not exist" in result.stderr, result.stderr[-3000:]
    assert list(tmp_path.glob("outputs/**/jobs.log")) == []


def test_a_refused_command_leaves_no_run_folder_and_no_run(tmp_path):
    """Its data refused in the dataset stage: the folder the command made for the run goes
    (and the date folder above it), and no MLflow run is made; a folder the user named
    stays."""
    missing = f"dataset.root={tmp_path / 'missing'}"
    store = f"tracking.uri={begun_store(tmp_path)}"
    result = run_kspipe("+experiment=omniglot_5way", missing, store, cwd=tmp_path)
    assert_one_line_error(result, "missing does not exist")
    assert not (tmp_path / "outputs").exists()
    named = tmp_path / "named"
    result = run_kspipe(
        "+experiment=omniglot_5way", missing, store, f"run_dir={named}", cwd=tmp_path
    )
    assert_one_line_error(result, "missing does not exist")
    assert named.is_dir()
    assert run_statuses(tmp_path / "mlflow.db") == []


def test_a_refused_job_of_a_sweep_leaves_no_folder_and_the_sweep_its_record(tmp_path, tiny_data):
    """A sweep's job refused (its data missing) has no run and no folder; the sweep's
    other job, its parent run and its comparison are as they would be, and the sweep
    fails naming the refused job.  (Its jobs in this process: an isolated job's process
    is launched with its run made, test_sweeps.py.)"""
    args = [
        a
        for a in tiny_overrides(tmp_path, tiny_data)
        if not a.startswith(("run_dir=", "dataset.root="))
    ]
    result = run_kspipe(
        "-m",
        "+experiment=omniglot_5way",
        *args,
        f"dataset.root={tiny_data},{tmp_path / 'missing'}",
        "train.meta_iters=1",
        "eval.baseline=false",
        "isolate=false",
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert (
        "1 job(s) of the sweep failed" in result.stderr
        and "missing does not exist" in result.stderr
    )
    assert "Traceback" not in result.stderr
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "comparison"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("kspipe.sweep") == "parent"]
    children = [r for r in runs if r is not parent]
    assert parent.info.status == "FAILED"
    assert [c.info.status for c in children] == ["FINISHED"]
    assert children[0].data.tags["mlflow.parentRunId"] == parent.info.run_id
    table = (sweep / "comparison" / "comparison.csv").read_text().splitlines()
    assert len(table) == 2 and str(tiny_data) in table[1]


def test_a_cluster_job_refused_for_what_its_workers_would_find_leaves_nothing(tmp_path):
    """``mode=pserver workers=2`` under kspipe's own launcher: a data folder that is not
    there, or a compile option Paddle no longer honours, which the workers' dataset and
    compile stages would refuse after the job began (a FAILED run and its folder, ~30 s
    later), is one line before any process starts: no run folder, no MLflow run."""
    cases = {
        f"dataset.root={tmp_path / 'missing'}": "missing does not exist",
        "+compile.execution_strategy.allow_op_delay=true": "no longer honours it",
    }
    commands = [  # both at once: each takes seconds to compose and check
        subprocess.Popen(
            [sys.executable, "-m", "kspipe.cli.command", "+experiment=omniglot_5way"]
            + ["mode=pserver", "workers=2", "cluster.launcher=processes", override]
            + [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for override in cases
    ]
    for command, said in zip(commands, cases.values()):
        out, err = command.communicate(timeout=120)
        assert_one_line_error(subprocess.CompletedProcess([], command.returncode, out, err), said)
    assert not (tmp_path / "outputs").exists()
    assert run_statuses(tmp_path / "mlflow.db") == []
