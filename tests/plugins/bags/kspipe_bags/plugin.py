"""Bag-of-ids regression: the target is the mean of a hidden weight per id, plus noise.

The model looks the ids up in a table made by ``role.embedding``, averages the rows and
maps them to one output; SGD (or Adam with Paddle's defaults: ``bags.optimizer``) is made
distributed with ``role.distributed_optimizer`` and every step is one ``exe.run``, whose
loss goes to the progress line.  ``bags.ids`` picks the ids' shape, ``bags.zipf`` how
often each id comes (a few often, most rarely).  ``bags.nan_from`` gives one worker NaN
targets from a step on, so its loss goes NaN there.  ``bags.pause_at`` has worker 0 work
``bags.pause_seconds`` at that step without training, a step of its own each second (as an
evaluation does), while the others wait for it.  The run writes its parameters to
``<run_dir>/params.npz`` for the tests to compare, and its model as OpenKS's
``save_persistables`` does (``<run_dir>/persistables.pd*``: the optimiser's state in
``.pdopt``), which ``init_from=`` reads.  ``bags.checkpoint_every`` epochs it writes a
checkpoint, each worker's optimiser state of its own beside the first's
(``checkpoints/worker-<i>/``), and ``resume=`` goes on from one on any number of workers
that the global batch divides among: each takes its slice of every batch anew, and a
worker the checkpoint has no state for starts from the first worker's.
``bags.nan_parameter`` has worker ``bags.nan_worker`` write a NaN into that parameter
when training ends (after its test metrics: no loss or metric shows it), or, with
``bags.nan_parameter_at=checkpoint``, before its last checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from kspipe import checkpoint, hookimpl
from kspipe.checkpoint.incremental import start_from
from kspipe.contracts import Workload
from kspipe.errors import ConfigError
from kspipe.files import user_path

NAME = "bags"


@dataclass
class BagsConfig:
    """The ``bags`` group."""

    ids: str = "fixed"  # fixed: [-1, words]; single: [-1, 1]; sequence: LoD, 1 to `words` ids
    vocabulary: int = 100  # rows of the embedding table
    width: int = 8  # its columns
    words: int = 5  # ids per bag
    train_points: int = 4096
    test_points: int = 1024
    batch_size: int = 64  # the global batch: each worker takes its slice of it
    epochs: int = 4
    learning_rate: float = 0.5
    optimizer: str = "sgd"  # sgd, or adam: paddle.optimizer.Adam with its defaults
    zipf: float = 0.0  # ids drawn from a Zipf law of this exponent (shifted to 0); 0: uniform
    nan_from: int = 0  # from this step on, worker nan_worker's targets are NaN; 0: never
    nan_worker: int = 0
    nan_parameter: str = ""  # a parameter worker nan_worker makes NaN (table, out.w ...)
    nan_parameter_at: str = "end"  # end: as execute returns; checkpoint: before the last one
    pause_at: int = 0  # at this step worker 0 works pause_seconds without training; 0: never
    pause_seconds: int = 0
    seed: int = 0
    checkpoint_every: int = 0  # epochs between checkpoints (0: none)


@hookimpl
def kspipe_config_dirs():
    return ["pkg://kspipe_bags.conf"]


@hookimpl
def kspipe_config_schemas():
    return {NAME: BagsConfig}


@hookimpl
def kspipe_check_config(cfg):
    """Every worker takes an equal slice of each global batch, at any size a job starts or
    resumes at."""
    if cfg.stages.program != NAME or cfg.get("mode", "local") == "local":
        return
    from kspipe.cluster.endpoints import process_count

    workers = process_count(cfg.workers, "workers")
    if cfg.bags.batch_size % workers:
        raise ConfigError(
            f"bags.batch_size={cfg.bags.batch_size} does not divide among {workers} workers"
        )


@hookimpl
def kspipe_describe_workload(cfg):
    return Workload(
        name=NAME,
        headline="test_r2",
        rate="samples_per_s",
        summary=("test_r2", "samples_per_s"),
        starts_from=True,
        resumes=True,
    )


@dataclass
class Bags:
    train: tuple  # (ids, lengths, targets)
    test: tuple


@hookimpl
def kspipe_read_dataset(cfg, role):
    c = cfg.bags
    rng = np.random.default_rng(c.seed)
    hidden = rng.normal(0.0, 1.0, c.vocabulary)

    def points(n):
        if c.zipf:
            ids = (rng.zipf(c.zipf, (n, c.words)) - 1) % c.vocabulary
        else:
            ids = rng.integers(0, c.vocabulary, (n, c.words))
        if c.ids == "single":
            lengths = np.ones(n, np.int64)
        elif c.ids == "sequence":
            lengths = rng.integers(1, c.words + 1, n)
        else:
            lengths = np.full(n, c.words, np.int64)
        mask = np.arange(c.words)[None, :] < lengths[:, None]
        y = (hidden[ids] * mask).sum(axis=1) / lengths + rng.normal(0.0, 0.1, n)
        return ids.astype(np.int64), lengths, y.astype(np.float32).reshape(-1, 1)

    return Bags(points(c.train_points), points(c.test_points))


@dataclass
class Programs:
    startup: object
    main: object
    test: object
    prediction: object
    loss: object


@hookimpl
def kspipe_build_program(cfg, dataset, role):
    import paddle

    c = cfg.bags
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = c.seed + 1
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        table = paddle.ParamAttr(name="table", initializer=paddle.nn.initializer.Normal(0.0, 0.1))
        y = paddle.static.data("y", [None, 1], "float32")
        if c.ids == "sequence":
            ids = paddle.static.data("ids", [None, 1], "int64", lod_level=1)
            rows = role.embedding(ids, [c.vocabulary, c.width], table)
            pooled = paddle.static.nn.sequence_pool(paddle.reshape(rows, [-1, c.width]), "average")
        else:
            width = 1 if c.ids == "single" else c.words
            ids = paddle.static.data("ids", [None, width], "int64")
            rows = role.embedding(ids, [c.vocabulary, c.width], table)
            pooled = paddle.mean(paddle.reshape(rows, [-1, width, c.width]), axis=1)
        prediction = paddle.static.nn.fc(
            pooled,
            1,
            weight_attr=paddle.ParamAttr(name="out.w"),
            bias_attr=paddle.ParamAttr(name="out.b"),
        )
        loss = paddle.mean(paddle.square(prediction - y))
    test = main.clone(for_test=True)
    return Programs(startup, main, test, prediction, loss)


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    import paddle

    with (
        paddle.utils.unique_name.guard(),
        paddle.static.program_guard(programs.main, programs.startup),
    ):
        rate = float(cfg.bags.learning_rate)
        if cfg.bags.optimizer == "adam":
            optimizer = paddle.optimizer.Adam(learning_rate=rate)
        else:
            optimizer = paddle.optimizer.SGD(learning_rate=rate)
        role.distributed_optimizer(optimizer).minimize(programs.loss)
    return programs


def feed(cfg, part: tuple, rows) -> dict:
    import paddle

    ids, lengths, y = part
    if cfg.bags.ids == "sequence":
        flat = np.concatenate([ids[i, : lengths[i]] for i in rows]).reshape(-1, 1)
        tensor = paddle.base.create_lod_tensor(
            flat, [[int(lengths[i]) for i in rows]], paddle.CPUPlace()
        )
        return {"ids": tensor, "y": y[rows]}
    if cfg.bags.ids == "single":
        return {"ids": ids[rows, :1], "y": y[rows]}
    return {"ids": ids[rows], "y": y[rows]}


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    import paddle

    c = cfg.bags
    workers, index = role.worker_num(), role.worker_index()
    share = c.batch_size // workers
    executor.run(programs.startup, scope=scope)
    first = resume(cfg, role, programs.main, scope, reporter) if cfg.resume else 0
    start = start_from(cfg, programs.main, scope, reporter.run_dir, reporter)
    role.init_worker(scope)
    start.load_tables(role)
    batches = c.train_points // c.batch_size
    seen, started = 0, time.perf_counter()
    for epoch in range(first, c.epochs):
        order = np.random.default_rng([c.seed, epoch]).permutation(c.train_points)
        for b in range(batches):
            rows = order[b * c.batch_size : (b + 1) * c.batch_size][
                index * share : (index + 1) * share
            ]
            step = epoch * batches + b + 1
            given = feed(cfg, dataset.train, rows)
            if c.nan_from and step >= c.nan_from and index == c.nan_worker:
                given["y"] = np.full_like(given["y"], np.nan)
            if step == c.pause_at and index == 0:
                for second in range(c.pause_seconds):
                    time.sleep(1.0)
                    reporter.progress("pause", second + 1, c.pause_seconds)
            (loss,) = executor.run(
                programs.main, scope=scope, feed=given, fetch_list=[programs.loss]
            )
            seen += len(rows)
            reporter.progress("train", step, c.epochs * batches, {"loss": float(np.mean(loss))})
        if c.nan_parameter_at == "checkpoint" and epoch + 1 == c.epochs:
            spoil(cfg, role, scope)
        if c.checkpoint_every and (epoch + 1) % c.checkpoint_every == 0:
            save_checkpoint(cfg, role, programs.main, scope, reporter, epoch + 1)
    seconds = time.perf_counter() - started
    role.finish_training(scope)
    metrics = {"samples_per_s": float(sum(role.all_gather(seen / seconds)))}
    if role.is_first_worker():
        everything = np.arange(c.test_points)
        (predicted,) = executor.run(
            programs.test,
            scope=scope,
            feed=feed(cfg, dataset.test, everything),
            fetch_list=[programs.prediction],
        )
        y = dataset.test[2]
        metrics["test_r2"] = float(1 - np.sum((predicted - y) ** 2) / np.sum((y - y.mean()) ** 2))
        np.savez(
            os.path.join(reporter.run_dir, "params.npz"),
            **{n: np.array(scope.find_var(n).get_tensor()) for n in ("table", "out.w", "out.b")},
        )
        with paddle.static.scope_guard(scope):
            paddle.static.save(programs.main, os.path.join(reporter.run_dir, "persistables"))
        reporter.metrics(metrics, step=c.epochs * batches)
    if c.nan_parameter_at == "end":
        spoil(cfg, role, scope)
    return metrics


def spoil(cfg, role, scope) -> None:
    """Worker ``bags.nan_worker``'s ``bags.nan_parameter`` (if set) takes a NaN."""
    if not cfg.bags.nan_parameter or role.worker_index() != cfg.bags.nan_worker:
        return
    tensor = scope.find_var(cfg.bags.nan_parameter).get_tensor()
    values = np.array(tensor)
    values.flat[0] = np.nan
    tensor.set(values, role.place())


def save_checkpoint(cfg, role, program, scope, reporter, epoch: int) -> None:
    """Every worker after ``epoch``: the first writes the model, each other its own state
    (its optimiser's moments) into ``checkpoints/worker-<i>/``, before the first."""
    role.settle_tables()
    folder, index = os.path.join(reporter.run_dir, "checkpoints"), role.worker_index()
    if index:
        folder = os.path.join(folder, f"worker-{index}")

    def save():
        checkpoint.save(program, scope, folder, epoch, {"epoch": epoch}, 2, cfg)

    if index:
        save()
    role.barrier_worker()
    if not index:
        save()
    role.barrier_worker()


def resume(cfg, role, program, scope, reporter) -> int:
    """Before ``init_worker``: the checkpoint's model (the first worker's become the
    job's), then this worker's own state if the checkpoint has one; its epoch."""
    epoch = checkpoint.load(program, scope, cfg.resume)["epoch"]
    index = role.worker_index()
    found = checkpoint.latest(user_path(cfg.resume))
    own = os.path.join(os.path.dirname(found), f"worker-{index}", os.path.basename(found))
    if index and os.path.isdir(own):
        checkpoint.load(program, scope, own)
    elif index:
        reporter.say(f"worker {index}: starts from the first worker's optimiser state")
    return epoch


@hookimpl
def kspipe_save_inference_model(cfg, role, programs, executor, scope, dirname):
    return None
