"""Evaluation only: a finished run (or one of its checkpoints) evaluated again without
training, as a new MLflow run that names its source."""

import pytest
from mlflow import MlflowClient

from kspipe.errors import ConfigError
from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager, tiny_overrides


def test_evaluating_a_finished_run_repeats_its_final_evaluation(tmp_path, tiny_data):
    common = [
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, tiny_data),
        "train.checkpoint_every=2",
        "train.meta_iters=4",
    ]
    trained = run(compose_config(common), plugin_manager())
    source = tmp_path / "run"
    again = run(
        compose_config([*common, f"run_dir={tmp_path / 'again'}", f"evaluate={source}"]),
        plugin_manager(),
    )
    # the same weights, the same test tasks: the same numbers.  On 9 queries they do not
    # tell the trained model from the untrained one (this run's baseline scored as it did),
    # so the weights are compared: the model evaluated is exported byte for byte as the
    # trained run exported its own (its last checkpoint's: tests/pipeline/test_pipeline.py)
    assert again["test_accuracy"] == trained["test_accuracy"]
    assert again["train_accuracy"] == trained["train_accuracy"]
    assert again["evaluated_meta_iteration"] == 4
    exported = [
        tmp_path / folder / "inference_model" / "model.pdiparams" for folder in ("run", "again")
    ]
    assert exported[1].read_bytes() == exported[0].read_bytes()
    assert not (tmp_path / "again" / "checkpoints").exists()  # nothing trained, nothing saved

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("kspipe").experiment_id],
        order_by=["attributes.start_time ASC"],
    )
    first, second = runs
    assert second.data.tags["kspipe.source_run"] == first.info.run_id
    assert second.data.params["evaluate"] == str(source)
    # the curve again, from the checkpoints: each point as training measured it
    first_curve, curve = (
        [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "curve/test_accuracy")]
        for r in runs
    )
    assert [step for step, _ in curve] == [2, 4] and curve == first_curve


def test_evaluate_takes_one_process(tmp_path, tiny_data):
    cfg = compose_config(
        [
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "mode=pserver",
            f"evaluate={tmp_path}",
        ]
    )
    with pytest.raises(ConfigError, match="evaluates in one process"):
        run(cfg, plugin_manager())
