"""A new kspipe workload: a plain supervised classifier, served for every mode at once.

Stages ``dataset``, ``program``, ``compile``, ``execute`` and ``save`` as ``classifier``
(``+experiment=blobs``).  Nothing here knows which mode runs it: the compile stage asks the
role for a distributed optimiser, the execute stage brackets its loop with
``role.init_worker`` / ``role.finish_training`` and feeds this worker its slice of each
global batch.  So ``mode=local``, ``mode=pserver`` and ``mode=collective`` (and any mode a
plugin adds) all train it.

The data: ``classifier.classes`` Gaussian blobs in ``classifier.features`` dimensions,
drawn from ``classifier.seed``; no files, no download.  The data set names itself in the
run's record (``Blobs.training_data``): the digest of its arrays, the same for every run of
the same settings.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np

from kspipe.api import (
    ConfigError,
    TrainingData,
    Workload,
    check_integer,
    check_number,
    hookimpl,
    process_count,
)

NAME = "classifier"


@hookimpl
def kspipe_config_dirs():
    return ["pkg://kspipe_classifier.conf"]


@hookimpl
def kspipe_describe_workload(cfg):
    return Workload(
        name=NAME,
        headline="test_accuracy",
        rate="samples_per_s",
        summary=("test_accuracy", "train_accuracy", "samples_per_s"),
    )


@dataclass
class ClassifierConfig:
    """The ``classifier`` group: its keys, their types and defaults (kspipe refuses a
    misspelt key or a value of the wrong type in one line)."""

    classes: int = 4  # blobs, one per class
    features: int = 8  # dimensions of a point
    spread: float = 1.2  # each blob's standard deviation (their centres are ~3 apart)
    train_points: int = 4000
    test_points: int = 1000
    hidden: int = 32  # the MLP's hidden layer
    learning_rate: float = 0.1  # SGD
    batch_size: int = 64  # the global batch: each worker takes its slice of it
    epochs: int = 3
    seed: int = 0


@hookimpl
def kspipe_config_schemas():
    return {NAME: ClassifierConfig}


@hookimpl
def kspipe_check_config(cfg):
    """The ranges (the schema checks keys and types), and the batch's split among the
    workers: the command that starts a cluster job calls this first, so a batch that does
    not divide stops the job in one line before any process starts."""
    if cfg.stages.program != NAME:
        return
    c = cfg.classifier
    for key, minimum in (
        ("classes", 2),
        ("features", 1),
        ("train_points", 1),
        ("test_points", 1),
        ("hidden", 1),
        ("batch_size", 1),
        ("epochs", 1),
    ):
        check_integer(c[key], f"classifier.{key}", minimum)
    check_number(c.learning_rate, "classifier.learning_rate", 0, above=True)
    check_number(c.spread, "classifier.spread", 0, above=True)
    workers = 1 if cfg.mode == "local" else process_count(cfg.workers, "workers")
    if c.batch_size % workers:
        raise ConfigError(
            f"classifier.batch_size={c.batch_size} must divide among the "
            f"{workers} workers (each takes an equal slice of every batch)"
        )


# --- dataset ------------------------------------------------------------------------


@dataclass
class Blobs:
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    classes: int
    features: int
    training_data: TrainingData | None = None  # the run's input in its MLflow record


@hookimpl
def kspipe_read_dataset(cfg, role):
    c = cfg.classifier
    rng = np.random.default_rng(c.seed)
    centres = rng.normal(0.0, 3.0 / np.sqrt(2), (c.classes, c.features))

    def points(n):
        y = rng.integers(0, c.classes, n)
        x = centres[y] + rng.normal(0.0, c.spread, (n, c.features))
        return x.astype(np.float32), y.astype(np.int64).reshape(-1, 1)

    train_x, train_y = points(c.train_points)
    test_x, test_y = points(c.test_points)
    arrays = (train_x, train_y, test_x, test_y)
    described = TrainingData(
        name="blobs",
        source=f"kspipe-classifier: generated from classifier.seed={c.seed}",
        digest=arrays_digest(arrays),
        profile={"train_points": c.train_points, "test_points": c.test_points},
    )
    return Blobs(*arrays, c.classes, c.features, training_data=described)


def arrays_digest(arrays) -> str:
    """8 hex digits of the SHA-256 of the arrays' values, as MLflow's data sets have."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:8]


# --- program and compile ------------------------------------------------------------


@dataclass
class Programs:
    startup: object
    main: object
    test: object
    x: object
    loss: object
    logits: object
    accuracy: object


@hookimpl
def kspipe_build_program(cfg, dataset, role):
    import paddle

    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = cfg.classifier.seed + 1  # 0 is "unseeded"
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [None, dataset.features], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        hidden = paddle.static.nn.fc(x, cfg.classifier.hidden, activation="relu")
        logits = paddle.static.nn.fc(hidden, dataset.classes)
        loss = paddle.nn.functional.cross_entropy(logits, y)
        accuracy = paddle.static.accuracy(paddle.nn.functional.softmax(logits), y)
    test = main.clone(for_test=True)
    return Programs(startup, main, test, x, loss, logits, accuracy)


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    import paddle

    with (
        paddle.utils.unique_name.guard(),
        paddle.static.program_guard(programs.main, programs.startup),
    ):
        optimizer = paddle.optimizer.SGD(learning_rate=cfg.classifier.learning_rate)
        role.distributed_optimizer(optimizer).minimize(programs.loss)
    return programs


# --- execute and save ---------------------------------------------------------------


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    c = cfg.classifier
    workers, index = role.worker_num(), role.worker_index()
    share = c.batch_size // workers  # whole: kspipe_check_config saw to it
    executor.run(programs.startup, scope=scope)
    role.init_worker(scope)
    batches = len(dataset.train_x) // c.batch_size
    total, seen, started = c.epochs * batches, 0, time.perf_counter()
    for epoch in range(c.epochs):
        order = np.random.default_rng([c.seed, epoch]).permutation(len(dataset.train_x))
        for b in range(batches):
            batch = order[b * c.batch_size : (b + 1) * c.batch_size][
                index * share : (index + 1) * share
            ]
            (loss,) = executor.run(
                programs.main,
                scope=scope,
                fetch_list=[programs.loss],
                feed={"x": dataset.train_x[batch], "y": dataset.train_y[batch]},
            )
            seen += len(batch)
            reporter.progress(
                "train",
                epoch * batches + b + 1,
                total,
                {"loss": float(np.mean(loss)), "epoch": epoch + 1},
            )
    seconds = time.perf_counter() - started
    role.finish_training(scope)
    rates = role.all_gather(seen / seconds)
    metrics = {"samples_per_s": float(sum(rates))}
    if role.is_first_worker():
        metrics["test_accuracy"] = accuracy(
            executor, scope, programs, dataset.test_x, dataset.test_y
        )
        metrics["train_accuracy"] = accuracy(
            executor, scope, programs, dataset.train_x, dataset.train_y
        )
        reporter.metrics(metrics, step=total)
    return metrics


def accuracy(executor, scope, programs, x, y) -> float:
    (logits,) = executor.run(
        programs.test, scope=scope, feed={"x": x, "y": y}, fetch_list=[programs.logits]
    )
    return float(np.mean(np.asarray(logits).argmax(axis=1) == y.ravel()))


@hookimpl
def kspipe_save_inference_model(cfg, role, programs, executor, scope, dirname):
    from kspipe.api import export_inference_model

    infer = programs.test._prune([programs.logits])
    return export_inference_model(
        cfg, dirname, infer, [programs.x], [programs.logits], executor, scope
    )
