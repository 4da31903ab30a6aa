"""ctr's metrics over every worker (issue 48, point 6): what each worker's program
accumulates, summed over the workers, gives the metrics PaddleRec's metric_helper gives
over all of their predictions in one process; a cluster's ``pass/*`` and ``train_auc``
are the job's."""

import json
import math

import numpy as np
import pytest

from kspipe.ctr import metrics as ctr_metrics
from kspipe.ctr.evaluation import roc_auc
from kspipe.testing import run_kspipe
from tests.kit import ctr_overrides


def worker_program():
    """A worker's metric ops as the ctr model builds them: the AUC op's histograms and
    the sums, over fed predictions and labels."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        pred = paddle.static.data("pred", [-1, 1], "float32")
        label = paddle.static.data("label", [-1, 1], "int64")
        _, _, stats = paddle.static.auc(paddle.concat([1.0 - pred, pred], axis=1), label)
        sums = ctr_metrics.accumulate(pred, label)
    return main, startup, stats[2].name, stats[3].name, sums


def reference(p: np.ndarray, y: np.ndarray) -> dict:
    """The metrics in one process over every prediction, PaddleRec's way: the AUC op's
    buckets (int(p * 4095)), metric_helper's AUC and bucket error over them, the rest
    from the predictions themselves."""
    buckets = (p * 4095).astype(np.int64)
    pos = np.bincount(buckets[y == 1], minlength=4096).astype(np.float64)
    neg = np.bincount(buckets[y == 0], minlength=4096).astype(np.float64)
    q = np.clip(p, 1e-7, 1 - 1e-7)
    return {
        "auc": ctr_metrics.auc(pos, neg),
        "bucket_error": ctr_metrics.bucket_error(pos, neg),
        "instances": len(p),
        "logloss": float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))),
        "actual_ctr": float(y.mean()),
        "predicted_ctr": float(p.mean()),
        "copc": float(y.mean() / p.mean()),
        "mae": float(np.abs(p - y).mean()),
        "rmse": float(math.sqrt(np.square(p - y).mean())),
    }


def test_the_workers_sums_give_the_metrics_of_all_their_predictions():
    """Two workers' scopes run the metric ops over their own batches; their states
    summed (what role.all_reduce_worker does) give exactly the metrics computed in one
    process over both workers' predictions; a new pass starts from zero."""
    import paddle

    rng = np.random.default_rng(3)
    n = 40_000
    y = rng.integers(0, 2, n)
    p = np.clip(0.3 + 0.3 * y + rng.normal(0, 0.2, n), 0.001, 0.999).astype(np.float32)
    main, startup, pos, neg, sums = worker_program()
    exe = paddle.static.Executor(paddle.CPUPlace())
    states = []
    for part in np.array_split(np.arange(n), 2):
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            exe.run(startup)
            for batch in np.array_split(part, 50):
                exe.run(
                    main,
                    feed={"pred": p[batch].reshape(-1, 1), "label": y[batch].reshape(-1, 1)},
                )
            states.append(ctr_metrics.local_state(scope, pos, neg, sums))
            ctr_metrics.zero(scope, [pos, neg, *sums])
            assert not ctr_metrics.local_state(scope, pos, neg, sums).any()
    job = ctr_metrics.metrics(states[0] + states[1])
    expected = reference(p.astype(np.float64), y)
    assert job["instances"] == expected["instances"] == n
    assert job["auc"] == expected["auc"]  # the same histograms, bucket for bucket
    assert job["bucket_error"] == expected["bucket_error"]
    for name in ("logloss", "actual_ctr", "predicted_ctr", "copc", "mae", "rmse"):
        assert job[name] == pytest.approx(expected[name], rel=1e-9), name
    assert job["auc"] == pytest.approx(roc_auc(y, p), abs=1e-3)  # buckets of 1/4095
    # one worker's own metrics are not the job's
    assert ctr_metrics.metrics(states[0])["instances"] == n // 2


def test_metric_helpers_bucket_error():
    """Buckets of 0.3 predicted with 20% clicks: an error of 1/3 of the predicted CTR."""
    pos, neg = np.zeros(4096), np.zeros(4096)
    at = int(0.3 * 4096)
    pos[at], neg[at] = 2000, 8000
    assert ctr_metrics.bucket_error(pos, neg) == pytest.approx(abs(0.2 / (at / 4096) - 1))
    assert ctr_metrics.auc(pos, neg) == 0.5


def test_a_clusters_pass_metrics_are_the_jobs(tmp_path):
    """2 workers, 2 passes: each pass's metrics count both workers' instances, and
    train_auc is the AUC of every pass's histograms of every worker.  One reader thread a
    worker: its threads add to the same accumulators unlocked (Hogwild, as Paddle's own
    AUC op does), and with two a batch's counts were once lost to their race (3,936 of
    4,000 instances counted)."""
    import mlflow

    result = run_kspipe(
        *ctr_overrides(
            tmp_path,
            "mode=pserver",
            "workers=2",
            "servers=2",
            "ctr.epochs=2",
            "datafeed.threads=1",
            "datafeed.generated.lines_per_file=1000",
            "cluster.timeout_s=300",
        ),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    history = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        for name in ("pass/instances", "pass/auc", "pass/copc", "train_auc", "pass/logloss")
    }
    assert history["pass/instances"] == {1: 4 * 1000, 2: 4 * 1000}  # both workers' files
    assert set(history["pass/auc"]) == set(history["pass/copc"]) == {1, 2}
    assert history["train_auc"][8000] == metrics["train_auc"]  # at the job's instances
    assert metrics["train_instances"] == 2 * 2 * 1000  # the first worker's own
    assert 0.5 < metrics["train_auc"] < 1 and metrics["train_logloss"] > 0
