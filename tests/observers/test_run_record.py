"""What a run's MLflow record says it is: its name (the experiment and the overrides the
user gave), its command line, the params of the config groups it reads only, and its
logged model (MLflow 3's ``models:/m-...``) with the run's final metrics, not the
baseline's."""

import pytest
from mlflow import MlflowClient

from kspipe.testing import run_kspipe, tiny_overrides


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
