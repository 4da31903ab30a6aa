"""The sweep's observers: the comparison and the learning curve show the metrics each
workload declares, not names written into them; a sweep's keys and a job's name are read by
Hydra's parser; the parent run of a sweep gets its children's artifacts and status; the
sweep callback counts a failed job, and a search's failed trials.  (Which observers may
import MLflow: registry/test_plugin_contract.py.)"""

import csv
import io
import os

from omegaconf import OmegaConf

from kspipe.contracts import Workload
from kspipe.observers import plots, sweep
from kspipe.observers.mlflow import sweep_runs, tags
from kspipe.observers.mlflow.sweep_runs import RunRecord
from kspipe.observers.progress import ProgressLine

REPTILE = Workload(
    name="reptile",
    headline="test_accuracy",
    rate="tasks_per_s",
    summary=("test_accuracy", "baseline_test_accuracy", "tasks_per_s"),
)
CTR = Workload(
    name="ctr",
    headline="test_auc",
    rate="samples_per_s",
    summary=("test_auc", "train_auc", "samples_per_s"),
)


def job(run_id, params, metrics, workload=None, status="FINISHED"):
    return RunRecord(
        run_id=run_id, name=None, status=status, params=params, metrics=metrics, workload=workload
    )


def test_a_comparison_shows_each_workloads_declared_metrics_and_their_union(tmp_path):
    jobs = [
        job(
            "a",
            {"stages.program": "reptile"},
            {
                "test_accuracy": 0.6,
                "test_accuracy_ci95": 0.05,
                "tasks_per_s": 40.0,
                "baseline_test_accuracy": 0.3,
                "train_loss": 1.0,
            },
            REPTILE,
        ),
        job(
            "b",
            {"stages.program": "ctr"},
            {"test_auc": 0.7, "train_auc": 0.72, "samples_per_s": 9000.0},
            CTR,
        ),
        job("c", {"stages.program": "reptile"}, {}, None, status="FAILED"),
    ]
    workloads = [j.workload or REPTILE for j in jobs]
    columns = sweep.comparison_columns(jobs, workloads)
    assert columns == [
        "test_accuracy",
        "test_accuracy_ci95",
        "baseline_test_accuracy",
        "tasks_per_s",
        "test_auc",
        "train_auc",
        "samples_per_s",
    ]
    rows = [
        sweep.comparison_row(j, ["stages.program"], w, columns) for j, w in zip(jobs, workloads)
    ]
    table = sweep.write_table(rows, columns, str(tmp_path / "comparison.csv"))
    read = list(csv.DictReader(open(table)))
    assert [r["job"] for r in read] == [
        "stages.program=reptile",
        "stages.program=ctr",
        "stages.program=reptile",
    ]
    assert [r["workload"] for r in read] == ["reptile", "ctr", "reptile"]
    assert read[1]["test_auc"] == "0.7" and read[1]["test_accuracy"] == ""
    assert plots.plot_comparison(rows, workloads, str(tmp_path / "comparison.png"))
    assert (tmp_path / "comparison.png").stat().st_size > 0


def test_no_ci95_column_where_no_job_reported_one():
    jobs = [job("a", {}, {"test_auc": 0.7, "samples_per_s": 10.0}, CTR)]
    assert sweep.comparison_columns(jobs, [CTR]) == ["test_auc", "train_auc", "samples_per_s"]


def test_the_workload_survives_its_tags():
    assert tags.workload_from_tags(tags.workload_tags(CTR)) == Workload(
        name="ctr", headline="test_auc", rate="samples_per_s", summary=CTR.summary
    )
    assert tags.workload_from_tags({"mlflow.runName": "x"}) is None


def test_the_learning_curve_plots_any_curve_series_and_the_headlines_baseline(tmp_path):
    curve = {
        "curve/train_loss": [(1, 2.0), (2, 1.5)],
        "curve/val_loss": [(1, 2.2), (2, 1.9)],
        "baseline_val_loss": [(0, 2.5)],
        "other": [(1, 3.0)],
    }
    assert plots.learning_curve(curve, str(tmp_path / "c.png"), "val_loss")
    assert plots.learning_curve({"other": [(1, 3.0)]}, str(tmp_path / "d.png"), "x") is None


def test_a_parent_run_gets_its_children_artifacts_and_status(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's artifact folder is relative to it
    monkeypatch.delenv(sweep_runs.PARENT_RUN_ENV, raising=False)
    cfg = OmegaConf.create(
        {"tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "kspipe"}}
    )
    parent = sweep_runs.start_parent_run(cfg, "sweep x=1,2", tags.workload_tags(REPTILE))
    assert os.environ[sweep_runs.PARENT_RUN_ENV] == parent
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    experiment = client.get_run(parent).info.experiment_id
    for x in (1, 2):
        child = client.create_run(
            experiment, tags={"mlflow.parentRunId": parent, **tags.workload_tags(REPTILE)}
        )
        client.log_param(child.info.run_id, "x", x)
        client.log_metric(child.info.run_id, "test_accuracy", x / 10)
        client.set_terminated(child.info.run_id, "FINISHED")
    children = sweep_runs.child_runs(cfg, parent)
    assert [(c.params["x"], c.metrics["test_accuracy"], c.workload.name) for c in children] == [
        ("1", 0.1, "reptile"),
        ("2", 0.2, "reptile"),
    ]
    (tmp_path / "comparison.csv").write_text("job\n")
    sweep_runs.finish_parent_run(
        cfg, parent, "FINISHED", [str(tmp_path / "comparison.csv")], {"kspipe.workload": "reptile"}
    )
    assert sweep_runs.PARENT_RUN_ENV not in os.environ
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.data.tags["kspipe.workload"] == "reptile"
    assert [a.path for a in client.list_artifacts(parent)] == ["comparison.csv"]


def test_a_sweeps_keys_and_a_jobs_name_are_read_by_hydras_parser():
    overrides = [
        "+experiment=omniglot_5way",
        "mode=pserver,local",
        "workers=range(1,3)",
        "train.inner_lr=interval(0.1,1)",
        "ctr.hidden=[64,32]",
        "run_name='a,b'",
        "hydra.sweeper.direction=maximize",
    ]
    assert sweep.swept_keys(overrides) == ["mode", "workers", "train.inner_lr"]
    assert sweep.swept_keys(["workers=(("]) == []  # composing the config names the mistake
    job = ["+experiment=omniglot_5way", "mode=local", "workers=2"]
    assert sweep.job_label(job, ["mode", "workers"]) == "mode=local,workers=2"
    assert sweep.job_label(job, []) is None


def test_the_sweep_callback_counts_a_failed_job_and_the_command_fails(capsys):
    """A job that failed in this process returns JobFailed (pickled back from a job process
    of another launcher); the sweep's end names it and exits non-zero, tracking or not."""
    import pickle

    import pytest
    from hydra.core.utils import JobReturn, JobStatus

    config = OmegaConf.create(
        {"tracking": {"enabled": False}, "hydra": {"overrides": {"task": ["workers=1,2"]}}}
    )
    callback = sweep.SweepCallback()
    callback.on_multirun_start(config)
    assert callback.swept == ["workers"]
    failed = pickle.loads(pickle.dumps(sweep.JobFailed(float("-inf"), "workers=2: why")))
    for value in (0.5, failed):
        callback.on_job_end(config, JobReturn(status=JobStatus.COMPLETED, _return_value=value))
    with pytest.raises(SystemExit) as ended:
        callback.on_multirun_end(config)
    assert ended.value.code == 1
    assert capsys.readouterr().err == (
        "kspipe: error: 1 job(s) of the sweep failed: workers=2: why\n"
    )
    callback.on_multirun_start(config)  # the next sweep starts afresh
    callback.on_multirun_end(config)


def test_a_searchs_failed_trials_are_said_and_its_end_is_the_searchs_own(capsys):
    """In a search (Hydra's optuna sweeper) a failed trial raised TrialFailed (pickled back
    from a job process of another launcher); the search that ran to its end exits as done,
    naming its failed trials; one its failures ended is the command's one line."""
    import pickle

    from hydra.core.utils import JobReturn, JobStatus

    config = OmegaConf.create(
        {
            "tracking": {"enabled": False},
            "hydra": {
                "overrides": {"task": ["train.inner_lr=interval(0.0001,0.01)"]},
                "sweeper": {
                    "_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
                    "max_failure_rate": 0.5,
                    "n_jobs": 2,
                },
            },
        }
    )
    callback = sweep.SweepCallback()
    failed = pickle.loads(pickle.dumps(sweep.TrialFailed("train.inner_lr=0.01: why")))
    assert (str(failed), failed.reason) == ("train.inner_lr=0.01: why",) * 2
    ok = JobReturn(status=JobStatus.COMPLETED, _return_value=0.5)
    bad = JobReturn(status=JobStatus.FAILED, _return_value=failed)
    ends = [
        # the sweeper raised the trial's error: more than 0.5 of a batch failed
        (
            (ok, bad),
            "the search ended: more than hydra.sweeper.max_failure_rate=0.5 of a batch of "
            "hydra.sweeper.n_jobs=2 trials failed: train.inner_lr=0.01: why",
        ),
        # optuna found no best trial: a ValueError
        (
            (bad, bad),
            "the search has no best trial: all 2 failed: train.inner_lr=0.01: why; "
            "train.inner_lr=0.01: why",
        ),
    ]
    for jobs, line in ends:
        callback.on_multirun_start(config)
        assert callback.search and callback.swept == ["train.inner_lr"]
        for job in jobs:
            callback.on_job_end(config, job)
        if jobs[0] is ok:
            assert sweep.failed_search(ValueError("another failure")) is None
        assert str(sweep.failed_search(failed if jobs[0] is ok else ValueError("none"))) == line
        assert sweep.failed_search(failed) is None  # said once: the search is over
    callback.on_multirun_start(config)
    for job in (ok, bad):
        callback.on_job_end(config, job)
    callback.on_multirun_end(config)  # no SystemExit: the search is done
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kspipe: 1 trial(s) of the search failed, recorded FAILED "
        "(hydra.sweeper.max_failure_rate=0.5): train.inner_lr=0.01: why"
    )


def test_a_progress_line_gives_the_time_left_and_a_short_tasks_tenths_of_seconds():
    """A stage done within seconds says how long it took, not ``0s``."""
    line = ProgressLine(stream=io.StringIO())
    assert line.format("evaluate", 3, 3, {"accuracy": 0.5}, 0.43) == (
        "evaluate 3/3 | accuracy 0.500 | took 0.4s"
    )
    assert line.format("meta-train", 1, 4, {"loss": 2.0}, 9.0, left=27.0) == (
        "meta-train 1/4 | loss 2.000 | left 27s"
    )
    assert line.format("meta-train", 1, 4, {}, 9.0) == "meta-train 1/4"  # no pace yet
    assert line.format("meta-train", 4, 4, {}, 185.2) == "meta-train 4/4 | took 3m05s"
    assert line.format("meta-train", 4, 4, {}, 3725.0) == "meta-train 4/4 | took 1h02m"


class Clock:
    """A clock the test moves on."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def shown(stream) -> list[str]:
    return stream.getvalue().splitlines()


def test_took_is_a_phases_wall_time_and_left_holds_across_its_evaluations():
    """Meta-training of 20 steps of 1 s, each 5th followed by a learning-curve point of
    5 s (two evaluations): the last line took the 35 s of the whole phase, and after each
    point the time left is the steps to go at the pace kept so far, evaluations included
    (never 0.0s, as when each point restarted the phase's clock)."""
    clock, stream = Clock(), io.StringIO()
    line = ProgressLine(stream=stream, clock=clock)
    line.every = 0.0  # every line shown
    line.kspipe_before_stage("execute", None)
    for step in range(1, 21):
        clock.now += 1.0
        line.update("meta-train", step, 20, {})
        if step % 5 == 0 and step < 20:
            for task in ("curve (train)", "curve (test)"):
                clock.now += 2.5
                line.update(task, 2, 2, {})
    lines = shown(stream)
    assert lines[-1] == "meta-train 20/20 | took 35s" and clock.now - 100.0 == 35.0
    assert "curve (train) 2/2 | took 2.5s" in lines
    after_points = [lines[i + 1] for i, text in enumerate(lines) if text.startswith("curve (test)")]
    # 2 s a step since the first seen (a point's 5 s spread over its 5 steps), and so on;
    # the first step seen has no pace yet
    assert after_points == [
        "meta-train 6/20 | left 28s",
        "meta-train 11/20 | left 18s",
        "meta-train 16/20 | left 8.0s",
    ]
    assert lines[0] == "meta-train 1/20"


def test_a_task_seen_first_at_its_end_took_the_time_since_the_last_thing_heard():
    """``evaluate 5/5`` reported once, 2 s after the training's last step; ctr's train
    reported once at its end, 7 s after its stage began: each took that, not 0.0s."""
    clock, stream = Clock(), io.StringIO()
    line = ProgressLine(stream=stream, clock=clock)
    line.update("meta-train", 4, 4, {})
    clock.now += 2.0
    line.update("evaluate", 5, 5, {"accuracy": 0.5})
    line.kspipe_before_stage("execute", None)
    clock.now += 7.0
    line.update("train", 40000, 40000, {})
    assert shown(stream)[-2:] == [
        "evaluate 5/5 | accuracy 0.500 | took 2.0s",
        "train 40000/40000 | took 7.0s",
    ]


def test_a_progress_line_on_a_real_clock(monkeypatch):
    """Real sleeps: a phase of three 0.2 s steps interrupted by a 0.3 s evaluation took
    0.9 s, give or take the machine's scheduling."""
    import re
    import time

    stream = io.StringIO()
    line = ProgressLine(stream=stream)
    line.every = 0.0
    line.kspipe_before_stage("execute", None)
    for step in (1, 2, 3):
        time.sleep(0.2)
        line.update("meta-train", step, 3, {})
        if step == 1:
            time.sleep(0.3)
            line.update("evaluate", 1, 1, {})
    took = re.fullmatch(r"meta-train 3/3 \| took (\d\.\d)s", shown(stream)[-1])
    assert took and 0.9 <= float(took.group(1)) <= 1.3, shown(stream)
