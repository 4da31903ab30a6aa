"""The held-out evaluation of the click-through model (exact AUC, log loss) and the
pull of its tables for export."""

from __future__ import annotations

import numpy as np

from kspipe.datafeed.files import python_batches


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC: the chance a random positive scores above a random negative."""
    labels = np.asarray(labels).reshape(-1).astype(bool)
    scores = np.asarray(scores, np.float64).reshape(-1)
    positives, negatives = labels.sum(), (~labels).sum()
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(average, counts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def evaluate(dataset, programs, executor, scope, reporter) -> dict:
    """AUC and log loss on the held-out files, fed from Python to the prediction program."""
    import paddle

    labels, scores = [], []
    test_feeds = set(programs.test.global_block().vars) & set(programs.feed_names)
    batches = python_batches(
        dataset.test_files, dataset.desc, dataset.batch_size, dict(dataset.dense_width)
    )
    seen, total = 0, dataset.test_counts.total if dataset.test_counts else 0
    with paddle.static.scope_guard(scope):
        for feed in batches:
            label = np.array(feed[dataset.label]).reshape(-1)
            feed = {k: v for k, v in feed.items() if k in test_feeds}
            (pred,) = executor.run(
                programs.test, feed=feed, fetch_list=[programs.pred], scope=scope
            )
            labels.append(label)
            scores.append(np.asarray(pred).reshape(-1))
            seen += len(label)
            reporter.progress("evaluate", seen, max(total, seen), {})
    y = np.concatenate(labels).astype(np.float64)
    p = np.clip(np.concatenate(scores), 1e-7, 1 - 1e-7)
    return {
        "test_auc": roc_auc(y, p),
        "test_logloss": float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))),
        "test_instances": int(len(y)),
        "test_ctr": float(y.mean()),
    }


def pull_tables(cfg, programs, executor, scope, chunk: int = 65536):
    """pserver: a scope with every trained variable of the infer program, tables included.

    Each embedding table's rows are pulled from the servers by running its lookup over
    ids 0..hash_size-1 (the lookup hashes ids by the same modulo, so row i is id i).
    """
    import paddle

    place = paddle.CPUPlace()
    export = paddle.static.Scope()
    hash_size = cfg.ctr.hash_size
    block = programs.main.global_block()
    for name, (slot, lookup, width) in programs.tables.items():
        pull = programs.main.clone(for_test=True)._prune([block.var(lookup)])
        rows = []
        for start in range(0, hash_size, chunk):
            ids = np.arange(start, min(hash_size, start + chunk), dtype=np.int64)
            if width:  # fixed-width id slot: whole instances of `width` ids
                pad = (-len(ids)) % width
                feed = np.concatenate([ids, np.zeros(pad, np.int64)]).reshape(-1, width)
            else:
                feed = paddle.base.create_lod_tensor(ids.reshape(-1, 1), [[1] * len(ids)], place)
            (out,) = executor.run(
                pull, feed={slot: feed}, fetch_list=[lookup], scope=scope, return_numpy=False
            )
            rows.append(np.array(out).reshape(-1, cfg.ctr.embedding_dim)[: len(ids)])
        export.var(name).get_tensor().set(np.concatenate(rows).astype(np.float32), place)
    for var in programs.infer.list_vars():
        if var.persistable and var.name not in programs.tables:
            value = scope.find_var(var.name)
            if value is not None:
                export.var(var.name).get_tensor().set(np.array(value.get_tensor()), place)
    return export
