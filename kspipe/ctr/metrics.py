"""The click-through metrics of a pass over every worker, as PaddleRec's ``metric_helper``
gives them: AUC and bucket error from the AUC op's histograms of positives and negatives
(summed over the workers), log loss, actual and predicted CTR, COPC, MAE and RMSE from
sums each worker's program accumulates (:func:`accumulate`).

Each worker's program adds to persistable variables in its scope as it trains; at a pass's
end every worker reads them, the job's totals are their sum (``role.all_reduce_worker``,
kspipe's own reduce, not fleet.metrics' gloo), and each worker zeroes its own for the
next pass.  The figures are then the job's, not the first worker's.
"""

from __future__ import annotations

import math

import numpy as np

#: The sums each worker accumulates, in this order.
SUMS = ("instances", "clicks", "predicted", "abs_error", "sq_error", "log_loss")
PREFIX = "_kspipe_ctr_sum_"


def accumulate(pred, label) -> list:
    """Add the batch's sums of :data:`SUMS` to persistable float64 variables (in the
    program being built); returns their names."""
    import paddle

    p = paddle.cast(paddle.reshape(pred, [-1]), "float64")
    y = paddle.cast(paddle.reshape(label, [-1]), "float64")
    clipped = paddle.clip(p, 1e-7, 1 - 1e-7)
    # paddle.add and friends, not + - *: on shapes of unknown batch size the operators
    # warn about Paddle 1's broadcasting, which no user of kspipe asked about.
    loss = -paddle.add(
        paddle.multiply(y, paddle.log(clipped)),
        paddle.multiply(1 - y, paddle.log(1 - clipped)),
    )
    values = {
        "instances": paddle.ones_like(p),
        "clicks": y,
        "predicted": p,
        "abs_error": paddle.abs(paddle.subtract(p, y)),
        "sq_error": paddle.square(paddle.subtract(p, y)),
        "log_loss": loss,
    }
    names = []
    for name in SUMS:
        total = paddle.static.create_global_var(
            [1], 0.0, "float64", persistable=True, name=PREFIX + name
        )
        total.stop_gradient = True
        paddle.assign(paddle.add(total, paddle.sum(values[name], keepdim=True)), output=total)
        names.append(total.name)
    return names


def local_state(scope, pos: str, neg: str, sums: list) -> np.ndarray:
    """This worker's histograms and sums as one float64 vector."""
    parts = [_read(scope, pos), _read(scope, neg)] + [_read(scope, n) for n in sums]
    return np.concatenate([p.reshape(-1) for p in parts])


def zero(scope, names: list) -> None:
    """Set the named accumulators in ``scope`` to zero (a new pass)."""
    import paddle

    for name in names:
        var = scope.find_var(name)
        if var is not None:
            tensor = var.get_tensor()
            value = np.array(tensor)
            tensor.set(np.zeros_like(value), paddle.CPUPlace())


def job_state(role, state: np.ndarray) -> np.ndarray:
    """The sum over every worker of ``state`` (every worker calls it)."""
    total = np.zeros_like(state)
    role.all_reduce_worker(state, total, "sum")
    return total


def metrics(state: np.ndarray) -> dict:
    """The metrics of a state vector (histograms then :data:`SUMS`), PaddleRec's way."""
    buckets = (len(state) - len(SUMS)) // 2
    pos, neg = state[:buckets], state[buckets : 2 * buckets]
    sums = dict(zip(SUMS, state[2 * buckets :]))
    n = sums["instances"]
    found = {
        "auc": auc(pos, neg),
        "bucket_error": bucket_error(pos, neg),
        "instances": int(round(n)),
    }
    if n > 0:
        actual, predicted = sums["clicks"] / n, sums["predicted"] / n
        found.update(
            logloss=sums["log_loss"] / n,
            actual_ctr=actual,
            predicted_ctr=predicted,
            copc=actual / predicted if predicted > 0 else float("nan"),
            mae=sums["abs_error"] / n,
            rmse=math.sqrt(sums["sq_error"] / n),
        )
    return found


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """metric_helper's calculate_auc: trapezoids from the highest bucket down."""
    area, tp, fp = 0.0, 0.0, 0.0
    for index in range(len(pos) - 1, -1, -1):
        new_tp, new_fp = tp + pos[index], fp + neg[index]
        area += (new_fp - fp) * (tp + new_tp) / 2
        tp, fp = new_tp, new_fp
    return 0.5 if tp * fp == 0 else float(area / (tp * fp))


def bucket_error(pos: np.ndarray, neg: np.ndarray) -> float:
    """metric_helper's calculate_bucket_error: the impressions-weighted relative error of
    the actual CTR against the predicted one over buckets merged until each is large
    enough (relative error bound 0.05, span 0.01)."""
    buckets = len(pos)
    last_ctr, impressions, ctr_sum, click_sum = -1.0, 0.0, 0.0, 0.0
    error_sum, error_count = 0.0, 0.0
    for i in range(buckets):
        ctr = i / buckets
        if abs(ctr - last_ctr) > 0.01:
            last_ctr, impressions, ctr_sum, click_sum = ctr, 0.0, 0.0, 0.0
        shows = pos[i] + neg[i]
        impressions += shows
        ctr_sum += ctr * shows
        click_sum += pos[i]
        if impressions == 0:
            continue
        adjusted = ctr_sum / impressions
        if adjusted == 0:
            continue
        if math.sqrt((1 - adjusted) / (adjusted * impressions)) < 0.05:
            error_sum += abs(click_sum / impressions / adjusted - 1) * impressions
            error_count += impressions
            last_ctr = -1.0
    return float(error_sum / error_count) if error_count > 0 else 0.0


def _read(scope, name: str) -> np.ndarray:
    var = scope.find_var(name)
    if var is None:
        return np.zeros(1)
    return np.array(var.get_tensor(), dtype=np.float64)
