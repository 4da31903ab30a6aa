"""Embedding tables from ``exe.run`` on parameter servers, with a workload written for these
tests (tests/plugins/bags: bag-of-ids regression through ``role.embedding`` and
``role.distributed_optimizer``), found through its entry point as a user's plugin is.

* ``cluster.strategy=sync`` ends with the parameters one process trains on the whole
  batches (float rounding apart), for ids of shape [-1, k], [-1, 1] and LoD sequences;
* two identical sync runs end with identical parameters, bit for bit;
* async and geo train the same model to the local run's R2 (within 0.02);
* a collective job trains the local model too (the table's gradient dense, all-reduced);
* a cluster run of a workload that exports no inference model is recorded FINISHED.
"""

import numpy as np
import pytest

from kspipe import testing


@pytest.fixture(scope="module")
def train(bags_run):
    """train(name, *overrides) -> (metrics, parameters) of one run, made once a session per
    name (tests/modes/conftest.py: test_launchers.py compares with the sync run too);
    ``train.folders[name]``: its run folder."""
    return bags_run


PSERVER = ["mode=pserver", "workers=2", "servers=2"]


@pytest.fixture(scope="module")
def tracked(train, tmp_path_factory):
    """The sync run once more, recorded in an MLflow store (the other runs here turn tracking
    off): the store, and the run's metrics and parameters."""
    folder = tmp_path_factory.mktemp("tracked-store")
    return folder / "mlflow.db", train(
        "sync-fixed-tracked",
        "bags.ids=fixed",
        *PSERVER,
        "cluster.strategy=sync",
        "tracking.enabled=true",
        f"tracking.uri={testing.begun_store(folder)}",
    )


def test_a_cluster_run_of_a_workload_that_exports_no_model_is_recorded(train, tracked):
    """bags' save stage writes nothing (its parameters are in params.npz): the run is
    recorded, FINISHED, with the tracking that the other tests here turn off."""
    store, _ = tracked
    assert testing.run_statuses(store) == ["FINISHED"]
    assert not (train.folders["sync-fixed-tracked"] / "inference_model").exists()


@pytest.mark.parametrize("ids", ["fixed", "single", "sequence"])
def test_sync_trains_the_local_model(train, ids):
    local, local_params = train(f"local-{ids}", f"bags.ids={ids}")
    cluster, params = train(f"sync-{ids}", f"bags.ids={ids}", *PSERVER, "cluster.strategy=sync")
    assert local["test_r2"] > 0.5  # it learns: an untrained model scores ~0
    for name, value in local_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=2e-5, err_msg=name)
    assert abs(cluster["test_r2"] - local["test_r2"]) < 1e-4


def test_collective_trains_the_local_model(train):
    """A collective job's all-reduce of the table's (dense) gradient: the parameters one
    process trains on the whole batches, float rounding apart."""
    local, local_params = train("local-fixed", "bags.ids=fixed")
    cluster, params = train("collective-fixed", "bags.ids=fixed", "mode=collective", "workers=2")
    for name, value in local_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=2e-5, err_msg=name)
    assert abs(cluster["test_r2"] - local["test_r2"]) < 1e-4


def test_sync_repeats_bit_for_bit(train, tracked):
    """The same sync job twice (the second recorded in MLflow, which trains nothing
    differently) ends with the same parameters, bit for bit."""
    _, first = train("sync-fixed", "bags.ids=fixed", *PSERVER, "cluster.strategy=sync")
    _, (_, again) = tracked
    assert set(again) == set(first)
    for name, value in first.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


@pytest.mark.parametrize("strategy, step", [("async", 0.25), ("geo", 0.5)])
def test_async_and_geo_train_the_model(train, strategy, step):
    """Async applies each worker's whole step (two workers: twice local's step per batch,
    hence half the learning rate); geo, their mean every k_steps."""
    local, _ = train("local-fixed", "bags.ids=fixed")
    cluster, _ = train(
        strategy,
        "bags.ids=fixed",
        *PSERVER,
        f"cluster.strategy={strategy}",
        "cluster.k_steps=4",
        f"bags.learning_rate={step}",
    )
    assert cluster["test_r2"] > local["test_r2"] - 0.02, (cluster, local)


def test_a_model_moves_between_one_process_and_the_servers(train):
    """init_from with a workload of its own: a sync cluster's model (its table on the
    servers) starts a one-process run, and a one-process model a cluster's, unchanged."""
    _, cluster_params = train("sync-fixed", "bags.ids=fixed", *PSERVER, "cluster.strategy=sync")
    _, params = train(
        "from-cluster",
        "bags.ids=fixed",
        "bags.epochs=0",
        f"init_from={train.folders['sync-fixed']}",
    )
    for name, value in cluster_params.items():
        np.testing.assert_array_equal(params[name], value)
    local, local_params = train("local-fixed", "bags.ids=fixed")
    again, params = train(
        "from-local",
        "bags.ids=fixed",
        *PSERVER,
        "cluster.strategy=async",
        "bags.epochs=0",
        f"init_from={train.folders['local-fixed']}",
    )
    for name, value in local_params.items():
        np.testing.assert_array_equal(params[name], value)
    assert again["test_r2"] == pytest.approx(local["test_r2"], abs=1e-6)
