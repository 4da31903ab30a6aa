"""mode=collective on CPU: two real processes whose meta-updates meet in a gloo all-reduce."""

import pytest
from mlflow import MlflowClient

from kspipe.errors import ConfigError
from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager, tiny_omniglot, tiny_overrides


def test_collective_workers_train_reptile_together(tmp_path_factory):
    data = tiny_omniglot(tmp_path_factory.mktemp("kanji60"), characters=60, drawers=8)
    tmp = tmp_path_factory.mktemp("collective")
    cfg = compose_config([
        "+experiment=omniglot_5way", f"dataset.root={data}", "dataset.train_characters=40",
        f"run_dir={tmp / 'run'}", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
        "model.filters=32", "task.shots=1", "train.shots=5", "train.meta_iters=300",
        "eval.tasks=60", "eval.inner_iters=20", "eval.interval=0", "seed=0",
        "mode=collective", "workers=2", "cluster.timeout_s=300"])
    metrics = run(cfg, plugin_manager())
    assert metrics["test_accuracy"] >= metrics["baseline_test_accuracy"] + 0.03, metrics
    assert metrics["worker0/tasks_per_s"] > 0 and metrics["worker1/tasks_per_s"] > 0
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    (record,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    assert record.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(record.info.run_id, "logs")} == {
        "logs/worker.0.log", "logs/worker.1.log"}


@pytest.mark.parametrize("overrides, message", [
    (["devices=[0,1]"], "this Paddle is a CPU build, so NCCL is not available"),
    (["devices='0'"], "this Paddle is a CPU build"),
    (["workers=0"], "workers=0 must be at least 1"),
])
def test_bad_collective_settings(tmp_path, tiny_data, overrides, message):
    cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data),
                          "mode=collective", *overrides])
    with pytest.raises(ConfigError, match=message):
        run(cfg, plugin_manager())
