"""Meta-training helps, in every mode: on a small seeded KanjiVG set, Reptile beats the
same evaluation of a model that was never meta-trained, by more than both 95% intervals,
and a cluster that saw the same tasks (split between two workers) learns as well as one
process did (within both intervals).  The exchanges' arithmetic is checked exactly in
test_exchange.py and test_collective.py; these are the long learning runs."""

import pytest
from mlflow import MlflowClient

from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager, tiny_omniglot


@pytest.fixture(scope="module")
def data60(tmp_path_factory):
    return tiny_omniglot(tmp_path_factory.mktemp("kanji60"), characters=60, drawers=8)


def learning_cfg(tmp_path, data, *overrides):
    return compose_config([
        "+experiment=omniglot_5way", f"dataset.root={data}", "dataset.train_characters=40",
        f"run_dir={tmp_path / 'run'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "model.filters=32", "task.shots=1", "train.shots=5", "train.meta_iters=300",
        "eval.tasks=60", "eval.inner_iters=20", "eval.interval=0", "seed=0", *overrides])


@pytest.fixture(scope="module")
def local(tmp_path_factory, data60):
    return run(learning_cfg(tmp_path_factory.mktemp("local"), data60), plugin_manager())


def test_meta_training_beats_the_baseline(local):
    trained, baseline = local["test_accuracy"], local["baseline_test_accuracy"]
    assert trained - baseline >= 0.08, local
    assert trained - local["test_accuracy_ci95"] > baseline + local["baseline_test_accuracy_ci95"]


@pytest.fixture(scope="module")
def local_big_batches(tmp_path_factory, data60):
    """The same 1500 tasks in meta-batches of 10: a sync or collective round of 2 workers."""
    return run(learning_cfg(tmp_path_factory.mktemp("local10"), data60, "train.meta_batch=10",
                            "train.meta_iters=150", "eval.baseline=false"), plugin_manager())


@pytest.mark.parametrize("mode", [
    ["mode=pserver", "cluster.strategy=async"],  # async: the workers interleave by timing
    ["mode=collective"]], ids=["pserver-async", "collective"])
def test_a_cluster_learns_as_one_process_over_the_same_tasks(tmp_path, data60, local,
                                                             local_big_batches, mode):
    cfg = learning_cfg(tmp_path, data60, *mode, "workers=2", "eval.baseline=false",
                       "cluster.timeout_s=600")
    metrics = run(cfg, plugin_manager())
    if "mode=collective" in mode:
        # a round averages the workers' meta steps: one step over both meta-batches
        reference = local_big_batches
    else:
        # async applies each worker's meta step as it comes: the steps of the local run
        reference = local
        assert (metrics["test_accuracy"] - metrics["test_accuracy_ci95"]
                > local["baseline_test_accuracy"] + local["baseline_test_accuracy_ci95"])
    both = metrics["test_accuracy_ci95"] + reference["test_accuracy_ci95"]
    assert abs(metrics["test_accuracy"] - reference["test_accuracy"]) <= both, (metrics, reference)
    assert metrics["worker0/tasks_per_s"] > 0 and metrics["worker1/tasks_per_s"] > 0

    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    (record,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    assert record.info.status == "FINISHED"
    assert record.data.metrics["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
    logs = {a.path for a in client.list_artifacts(record.info.run_id, "logs")}
    expected = {"logs/worker.0.log", "logs/worker.1.log"}
    assert logs == (expected | {"logs/server.0.log"} if "mode=pserver" in mode else expected)
    assert "inference_model" in {a.path for a in client.list_artifacts(record.info.run_id)}


@pytest.mark.parametrize("options", [
    ["train.algorithm=foml", "train.foml_tail=1"],
    ["train.inner_optimizer=sgd", "train.inner_lr=0.1"],
], ids=["foml", "sgd"])
def test_other_inner_loops_learn(tmp_path, data60, local, options):
    metrics = run(learning_cfg(tmp_path, data60, *options, "tracking.enabled=false",
                               "eval.baseline=false"), plugin_manager())
    assert (metrics["test_accuracy"] - metrics["test_accuracy_ci95"]
            > local["baseline_test_accuracy"] + local["baseline_test_accuracy_ci95"]), metrics
