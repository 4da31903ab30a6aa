"""The held-out evaluation of the click-through model (exact AUC, log loss) and the
pull of its tables for export."""

from __future__ import annotations

import os

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


def pull_tables(cfg, programs, executor, scope, role=None, run_dir: str = "."):
    """A scope with every trained variable of the infer program, tables included, pulled
    from wherever the mode keeps them.

    Hashed ids: each table's ``ctr.hash_size`` rows, pulled by running its lookup over ids
    0..hash_size-1 (the lookup hashes ids by the same modulo, so row i is id i).  Raw ids
    on the servers: the rows the tables hold, found by saving the tables (their files'
    first column) and pulled by their ids; the infer program is built anew to look ids up
    among them (:func:`kspipe.ctr.model.key_lookup`), so its size follows the tables.
    """
    import paddle

    from kspipe.ctr.model import infer_program, key_lookup

    place = paddle.CPUPlace()
    export = paddle.static.Scope()
    if programs.raw_ids:
        held = held_ids(role, run_dir)
        wanted = {name: np.sort(held[name].view(np.int64)) for name in programs.tables}
        programs.infer, net = infer_program(
            programs.dataset,
            cfg.ctr,
            key_lookup({name: len(ids) for name, ids in wanted.items()}),
            hashed=False,
        )
        programs.infer_feeds, programs.infer_pred = net["feeds"], net["pred"]
    else:
        wanted = {name: np.arange(cfg.ctr.hash_size, dtype=np.int64) for name in programs.tables}
    for name, ids in wanted.items():
        rows = pull_rows(programs, executor, scope, name, ids, cfg.ctr.embedding_dim)
        if programs.raw_ids:  # the unknown ids' row, then the ids the rows belong to
            rows = np.concatenate([rows, np.zeros((1, rows.shape[1]), np.float32)])
            export.var(f"{name}.keys").get_tensor().set(
                ids if len(ids) else np.zeros(1, np.int64), place
            )
        export.var(name).get_tensor().set(rows, place)
    for var in programs.infer.list_vars():
        if var.persistable and var.name not in programs.tables:
            value = scope.find_var(var.name)
            if value is not None:
                export.var(var.name).get_tensor().set(np.array(value.get_tensor()), place)
    return export


def held_ids(role, run_dir: str) -> dict:
    """``{table name: ids (uint64)}`` of the rows the servers' sparse tables hold now."""
    import shutil

    from kspipe.checkpoint.tables import table_ids

    folder = os.path.join(run_dir, "held-tables")
    shutil.rmtree(folder, ignore_errors=True)
    try:
        role.save_tables(folder)
        return table_ids(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def pull_rows(programs, executor, scope, name, ids, width: int, chunk: int = 65536):
    """The rows of table ``name`` for ``ids`` (int64), as its training lookup returns them."""
    import paddle

    place = paddle.CPUPlace()
    slot, lookup, per_instance = programs.tables[name]
    block = programs.main.global_block()
    pull = programs.main.clone(for_test=True)._prune([block.var(lookup)])
    rows = [np.zeros((0, width), np.float32)]
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        if per_instance:  # fixed-width id slot: whole instances of `per_instance` ids
            pad = (-len(part)) % per_instance
            feed = np.concatenate([part, np.zeros(pad, np.int64)]).reshape(-1, per_instance)
        else:
            feed = paddle.base.create_lod_tensor(part.reshape(-1, 1), [[1] * len(part)], place)
        (out,) = executor.run(
            pull, feed={slot: feed}, fetch_list=[lookup], scope=scope, return_numpy=False
        )
        rows.append(np.array(out).reshape(-1, width)[: len(part)])
    return np.concatenate(rows).astype(np.float32)
