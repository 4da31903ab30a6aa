"""What a run's MLflow record says it is: its name (the experiment and the overrides the
user gave), its command line, the params of the config groups it reads only, and its
logged model (MLflow 3's ``models:/m-...``) with the run's final metrics, not the
baseline's; when it is made (a job refused before its execute stage has none), and why a
job that failed after failed."""

import pytest
from mlflow import MlflowClient

from kspipe.testing import begun_store, compose_config, run_kspipe, tiny_overrides


@pytest.fixture(scope="module")
def reptile_run(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("record")
    result = run_kspipe(
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp, tiny_data),
        "train.meta_iters=3",
        "eval.interval=0",
        "tracking.model=true",
        "tracking.system_metrics=false",
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    return client, run


def test_the_logged_model_carries_the_final_metrics_not_the_baseline(reptile_run):
    client, run = reptile_run
    (model,) = client.search_logged_models([run.info.experiment_id])
    assert model.source_run_id == run.info.run_id
    scores = {metric.key: metric for metric in model.metrics}
    assert set(scores) == {"test_accuracy", "test_accuracy_ci95"}
    assert scores["test_accuracy"].value == run.data.metrics["test_accuracy"]
    assert scores["test_accuracy"].step == 3  # the step the run logged it at
    assert "baseline_test_accuracy" in run.data.metrics  # on the run only
    (output,) = run.outputs.model_outputs
    assert output.model_id == model.model_id and output.step == 3


def test_a_run_is_named_by_its_experiment_and_overrides_and_tags_its_command(reptile_run):
    _, run = reptile_run
    name = run.info.run_name
    assert name.startswith("omniglot_5way ") and "train.meta_iters=3" in name.split()
    assert len(name) <= 200  # the tests' many overrides: cut where the runs table would
    for path_key in ("dataset.root", "run_dir", "tracking.uri", "tracking.model"):
        assert path_key not in name, name
    command = run.data.tags["kspipe.command"]
    assert command.startswith("kspipe ") and "+experiment=omniglot_5way" in command.split()
    assert "train.meta_iters=3" in command.split()


def test_a_run_logs_the_params_of_the_groups_it_reads_only(reptile_run):
    _, run = reptile_run
    groups = {key.split(".")[0] for key in run.data.params}
    assert {"train", "task", "model", "eval", "dataset", "cluster", "tracking"} <= groups
    assert {"mode", "workers", "seed"} <= set(run.data.params)
    assert not groups & {"ctr", "datafeed", "classifier"}, sorted(groups)


@pytest.mark.parametrize("failing", ["dataset", "execute"])
def test_a_run_is_made_as_its_job_starts_and_keeps_why_it_failed(tmp_path, failing):
    """A job refused before its execute stage (here its data): no run, nor its config in
    the run folder.  A job that failed once it started (the execute stage) keeps the line
    its user was told as the run's tag ``kspipe.error``; its system metrics and data set,
    asked for before the run was made, are recorded in it."""
    from kspipe.contracts import TrainingData, Workload
    from kspipe.errors import DataError
    from kspipe.observers.mlflow.tracking import MlflowTracker
    from kspipe.role import Role

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = begun_store(tmp_path)
    cfg = compose_config(
        [
            "+experiment=omniglot_5way",
            f"tracking.uri={store}",
            f"run_dir={run_dir}",
            "tracking.system_metrics_interval=0.2",
        ]
    )
    (tmp_path / "a.png").write_bytes(b"an image")
    data = TrainingData("tiny", str(tmp_path), (str(tmp_path / "a.png"),))
    tracker = MlflowTracker()
    workload = Workload(name="reptile", headline="test_accuracy", rate="tasks_per_s")
    tracker.kspipe_run_start(cfg=cfg, role=Role(), run_dir=str(run_dir), workload=workload)
    for stage in ("dataset", "program", "compile", "execute"):
        tracker.kspipe_before_stage(stage=stage, cfg=cfg)
        if stage == failing:
            break
        result = type("Read", (), {"training_data": data})() if stage == "dataset" else None
        tracker.kspipe_after_stage(stage=stage, cfg=cfg, result=result)
    tracker.kspipe_run_error(cfg=cfg, error=DataError(f"{failing}: no good\nmore"))
    client = MlflowClient(tracking_uri=store)
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    if failing != "execute":
        assert found == [] and list(run_dir.iterdir()) == []
        return
    (run,) = found
    assert run.info.status == "FAILED"
    assert run.data.tags["kspipe.error"] == "execute: no good"
    assert (run_dir / "config.yaml").is_file()
    assert [i.dataset.name for i in run.inputs.dataset_inputs] == ["tiny"]
    assert any(key.startswith("system/") for key in run.data.metrics), run.data.metrics
