"""A click-through-rate model trained from MultiSlot files (``stages.*=ctr``).

Stages ``program``, ``compile``, ``execute`` and ``save`` of ``+experiment=ctr_datafeed``.
The model: each used uint64 slot's ids are hashed into ``ctr.hash_size`` rows of an
embedding table of its own, a variable-length (LoD) slot's embeddings are summed, float
slots join as they are, and a small ReLU tower gives the click logit.  Training is
Paddle's ``Executor.train_from_dataset`` (the successor of AsyncExecutor): C++ threads
read and parse the files, each thread trains Hogwild on its own files, no Python in the
data path.

``mode=local`` trains in one process.  ``mode=pserver`` puts the embedding tables on the
servers (``sparse_embedding``: rows created as ids are seen, pulled and pushed every
batch) and the tower's dense parameters in the servers' dense table; fleet's async
strategy is the one that trains through ``train_from_dataset`` on Paddle 2.6.2 (its
device worker pulls and pushes dense parameters every batch).  The first worker then
pulls the tables and exports a self-contained inference model, the same as a local run's.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kspipe import checkpoint, hookimpl
from kspipe.datafeed import python_batches
from kspipe.errors import ConfigError

FETCH_LINE = re.compile(r"^time: \[[^\]]*\], batch: \[(\d+)\], (.*)$")
FETCH_ITEM = re.compile(r"([^\s,\[\]]+)\[\d+\]:\[([^\]]*)\]")
MODES = ("local", "pserver")


@dataclass
class CtrPrograms:
    startup: object
    main: object  # one training step (after the compile stage: with its optimiser)
    infer: object  # prediction with plain embedding tables, for export
    loss: object
    pred: object
    stat_pos: str  # the AUC op's accumulated histograms (persistable)
    stat_neg: str
    feed_names: list  # used slots, in file order
    infer_feeds: list  # the infer program's feed variables (no label)
    infer_pred: object
    tables: dict  # embedding parameter -> (slot, lookup output variable, ids per instance or 0)
    distributed: bool
    learning_rate: float
    test: object = None  # set by the compile stage: prediction only, over the trained variables
    fetch: dict = field(default_factory=dict)  # name shown -> variable printed while training
    export_scope: object = None  # pserver: the pulled tables and dense parameters


# --- program -------------------------------------------------------------------------


@hookimpl
def kspipe_check_config(cfg):
    if cfg.stages.program == "ctr":
        check(cfg)


@hookimpl
def kspipe_build_program(cfg, dataset):
    import paddle

    m = cfg.ctr
    distributed = cfg.mode == "pserver"
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = cfg.seed
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        net = network(dataset, m, distributed, with_label=True)
    infer = paddle.static.Program()  # its parameters are the trained ones, shared by name
    unused_startup = paddle.static.Program()
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(infer, unused_startup):
        infer_net = network(dataset, m, distributed=False, with_label=False)
    return CtrPrograms(
        startup=startup, main=main, infer=infer,
        loss=net["loss"], pred=net["pred"], stat_pos=net["stat_pos"], stat_neg=net["stat_neg"],
        feed_names=[v.name for v in net["feeds"]], infer_feeds=infer_net["feeds"],
        infer_pred=infer_net["pred"],
        tables=net["tables"], distributed=distributed, learning_rate=float(m.learning_rate))


def check(cfg) -> None:
    m = cfg.ctr
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode}: the ctr workload runs in mode local or pserver")
    if cfg.mode == "pserver" and cfg.resume:
        raise ConfigError("resume: the ctr workload resumes in mode=local only (the servers' "
                          "embedding tables and optimiser state are not checkpointed)")
    if cfg.mode == "pserver" and cfg.cluster.strategy != "async":
        raise ConfigError(f"cluster.strategy={cfg.cluster.strategy}: the ctr workload trains "
                          f"with async on Paddle 2.6.2 (fleet's sync crashes in send_barrier "
                          f"and its geo mode sends no dense parameters)")
    for key in ("embedding_dim", "hash_size", "epochs"):
        value = m.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"ctr.{key}={value!r} must be a positive integer")
    if not all(isinstance(h, int) and h > 0 for h in m.hidden):
        raise ConfigError(f"ctr.hidden={list(m.hidden)!r} must be a list of positive layer sizes")
    lr = m.learning_rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
        raise ConfigError(f"ctr.learning_rate={lr!r} must be a positive number")
    period = cfg.datafeed.print_period_s
    if isinstance(period, bool) or not isinstance(period, (int, float)) or period <= 0:
        raise ConfigError(f"datafeed.print_period_s={period!r} must be a positive number")
    batches = cfg.datafeed.print_period
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ConfigError(f"datafeed.print_period={batches!r} must be a positive number of batches")


def network(dataset, m, distributed: bool, with_label: bool) -> dict:
    """The model over ``dataset``'s used slots; parameters named so programs share them."""
    import paddle

    desc, label = dataset.desc, dataset.label
    init = paddle.nn.initializer.Uniform(-0.05, 0.05)
    feeds, parts, tables, label_var = [], [], {}, None
    for slot in desc.used_slots:
        if slot.name == label and not with_label:
            continue
        dtype = "int64" if slot.type == "uint64" else "float32"
        if slot.is_dense:
            width = dataset.dense_width[slot.name]
            var = paddle.static.data(slot.name, [-1, width], dtype)
        else:
            var = paddle.static.data(slot.name, [-1, 1], dtype, lod_level=1)
        feeds.append(var)
        if slot.name == label:
            label_var = var
            continue
        if slot.type == "float":
            parts.append(var if slot.is_dense else paddle.static.nn.sequence_pool(var, "sum"))
            continue
        ids = paddle.remainder(var, paddle.full([1], m.hash_size, "int64"))
        name = f"emb_{slot.name}"
        attr = paddle.ParamAttr(name=name, initializer=init)
        size = [m.hash_size, m.embedding_dim]
        if distributed:
            emb = paddle.static.nn.sparse_embedding(ids, size=size, param_attr=attr)
        else:
            emb = paddle.static.nn.embedding(ids, size=size, is_sparse=True, param_attr=attr)
        tables[name] = (slot.name, emb.name, dataset.dense_width.get(slot.name, 0))
        if slot.is_dense:  # a fixed number of ids per instance: their embeddings side by side
            parts.append(paddle.reshape(emb, [-1, dataset.dense_width[slot.name] * m.embedding_dim]))
        else:
            parts.append(paddle.static.nn.sequence_pool(paddle.squeeze(emb, axis=1), "sum"))
    x = paddle.concat(parts, axis=1) if len(parts) > 1 else parts[0]
    for i, size in enumerate(m.hidden):
        x = paddle.static.nn.fc(x, size, activation="relu",
                                weight_attr=paddle.ParamAttr(name=f"tower_{i}.w"),
                                bias_attr=paddle.ParamAttr(name=f"tower_{i}.b"))
    logit = paddle.static.nn.fc(x, 1, weight_attr=paddle.ParamAttr(name="tower_out.w"),
                                bias_attr=paddle.ParamAttr(name="tower_out.b"))
    pred = paddle.nn.functional.sigmoid(logit)
    net = {"feeds": feeds, "pred": pred, "tables": tables}
    if with_label:
        loss = paddle.mean(paddle.nn.functional.binary_cross_entropy_with_logits(
            logit, paddle.cast(label_var, "float32")))
        _, _, stats = paddle.static.auc(paddle.concat([1.0 - pred, pred], axis=1), label_var)
        net.update(loss=loss, stat_pos=stats[2].name, stat_neg=stats[3].name)
    return net


# --- compile: the optimiser, locally or transpiled for the servers ----------------------


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    import paddle

    optimizer = paddle.optimizer.Adam(programs.learning_rate, lazy_mode=True)
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(programs.main,
                                                                       programs.startup):
        if programs.distributed:
            import paddle.distributed.fleet as fleet

            strategy = fleet.DistributedStrategy()
            strategy.a_sync = True
            fleet.distributed_optimizer(optimizer, strategy).minimize(programs.loss)
            programs.main = programs.loss.block.program  # fleet's rewritten worker program
            programs.startup = paddle.static.default_startup_program()
        else:
            optimizer.minimize(programs.loss)
    programs.test = programs.main.clone(for_test=True)._prune([programs.pred])
    programs.fetch = fetch_vars(programs, list(cfg.datafeed.fetch or []))
    return programs


def fetch_vars(programs, names: list[str]) -> dict:
    """The variables of ``datafeed.fetch`` (``loss`` names the model's loss)."""
    block = programs.main.global_block()
    found = {}
    for name in names:
        if name == "loss":
            found[name] = programs.loss
        elif block.has_var(name):
            found[name] = block.var(name)
        else:
            known = sorted(v.name for v in block.vars.values() if not v.name.endswith("@GRAD"))
            raise ConfigError(f"datafeed.fetch: the program has no variable {name!r} "
                              f"(loss, or one of: {', '.join(known[:12])}, ...)")
    return found


# --- execute ------------------------------------------------------------------------


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    import paddle

    if programs.distributed and role.is_server():
        role.fleet.init_server()
        reporter.say(f"server {role.server_index()} ready")
        role.fleet.run_server()
        return {}
    with paddle.static.scope_guard(scope):
        executor.run(programs.startup)
        if programs.distributed:
            role.fleet.init_worker(scopes=[scope])
    try:
        metrics = train(cfg, role, dataset, programs, executor, scope, reporter)
        if programs.distributed:
            from kspipe.builtin.pserver import pull_all_dense

            role.barrier_worker()  # every push is in: the servers hold the final model
            pull_all_dense(role.fleet)
        if role.is_first_worker():
            metrics.update(evaluate(dataset, programs, executor, scope, reporter))
            if programs.distributed:
                programs.export_scope = pull_tables(cfg, programs, executor, scope)
            reporter.metrics(metrics, step=metrics["train_instances"])
        if programs.distributed:
            role.barrier_worker()
    finally:
        if programs.distributed:
            if role.is_first_worker():
                role.fleet.fleet._runtime_handle._worker.stop_server()
            role.fleet.stop_worker()
    return metrics


#: The reader-thread count of this process's first ``train_from_dataset``: Paddle 2.6.2
#: sizes the trainer's thread pool once per process and aborts on another count.
_process_threads: int | None = None


def claim_threads(threads: int) -> None:
    global _process_threads
    if _process_threads is None:
        _process_threads = threads
    elif threads != _process_threads:
        raise ConfigError(
            f"this process already trained from files with {_process_threads} reader "
            f"thread(s); Paddle 2.6.2 keeps that thread pool for the life of a process and "
            f"aborts on {threads}: run with isolate=true (a process of its own)")


def train(cfg, role, dataset, programs, executor, scope, reporter) -> dict:
    """``train_from_dataset`` over this worker's files, ``ctr.epochs`` times."""
    claim_threads(dataset.threads)
    epochs = cfg.ctr.epochs
    per_epoch = dataset.train_counts.total
    printer = FetchPrinter(reporter, cfg.datafeed.print_period)
    monitor = Monitor(programs, scope, reporter, per_epoch * epochs, cfg.datafeed.print_period_s,
                      printer)
    names = list(programs.fetch)
    first_epoch = 0
    if cfg.resume:
        progress = checkpoint.load(programs.main, scope, executor, cfg.resume)
        first_epoch = progress["epoch"]
        reporter.say(f"resumed after epoch {first_epoch} from {cfg.resume}")
    reporter.say(f"training on {len(dataset.train_files)} file(s), {per_epoch} instances, "
                 f"{dataset.threads} reader thread(s), epochs {first_epoch + 1}-{epochs}")
    started = time.perf_counter()
    for epoch in range(first_epoch, epochs):
        files = make_dataset(dataset)
        with monitor, printer:
            executor.train_from_dataset(
                program=programs.main, dataset=files, scope=scope, thread=dataset.threads,
                debug=False, fetch_list=list(programs.fetch.values()) or None,
                fetch_info=names or None, print_period=cfg.datafeed.print_period)
        if dataset.kind == "in_memory":
            files.release_memory()
        monitor.report(epoch_done=epoch + 1)
        if not programs.distributed:  # the servers' tables are not checkpointed
            checkpoint.save(programs.main, scope, os.path.join(reporter.run_dir, "checkpoints"),
                            epoch + 1, {"epoch": epoch + 1}, cfg.train.keep_checkpoints)
    seconds = time.perf_counter() - started
    auc = monitor.auc()
    samples = per_epoch * (epochs - first_epoch)
    rate = np.array([samples / seconds if samples else 0.0], np.float64)
    total_rate = np.zeros_like(rate)
    role.all_reduce_worker(rate, total_rate, "sum")
    metrics = {"train_auc": auc, "samples_per_s": float(total_rate[0]),
               "worker_samples_per_s": float(rate[0]), "train_instances": samples,
               "train_seconds": seconds}
    metrics.update({f"fetch_{name}": value for name, value in printer.latest.items()})
    return metrics


def make_dataset(dataset):
    """A QueueDataset (streamed) or InMemoryDataset (loaded, shuffled) over the files."""
    import paddle

    if dataset.kind == "queue":
        files = paddle.distributed.QueueDataset()
    else:
        files = paddle.distributed.InMemoryDataset()
    files.init(batch_size=dataset.batch_size, thread_num=dataset.threads, use_var=[],
               pipe_command="cat")
    slots = files.proto_desc.multi_slot_desc.slots
    for slot in dataset.desc.slots:  # every slot, used or not: the reader walks them all
        copy = slots.add()
        copy.CopyFrom(slot)
        if slot.is_dense and slot.name in dataset.dense_width:
            del copy.shape[:]
            copy.shape.extend([-1, dataset.dense_width[slot.name]])
    files.set_filelist(list(dataset.train_files))
    if dataset.kind == "in_memory":
        files.load_into_memory()
        files.local_shuffle()
    return files


class Monitor:
    """Every ``period`` seconds while ``train_from_dataset`` runs, reads the instances seen
    and the running AUC from the AUC op's histograms (persistable, in the scope) and shows
    them, with the printer's latest fetched values, in the progress line.
    """

    def __init__(self, programs, scope, reporter, total: int, period: float, printer):
        self.p, self.scope, self.reporter = programs, scope, reporter
        self.total, self.period, self.printer = total, period, printer
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kspipe-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.report()

    def seen(self) -> int:
        return int(self._read(self.p.stat_pos).sum() + self._read(self.p.stat_neg).sum())

    def auc(self) -> float:
        return auc_from_histograms(self._read(self.p.stat_pos), self._read(self.p.stat_neg))

    def report(self, epoch_done: int | None = None) -> None:
        seen, auc = min(self.seen(), self.total), self.auc()
        shown = {"auc": auc, **self.printer.latest}
        if epoch_done:
            shown["epoch"] = epoch_done
        self.reporter.progress("train", seen, self.total, shown)
        self.reporter.metrics({"train_auc": auc}, step=seen)

    def _read(self, name: str) -> np.ndarray:
        var = self.scope.find_var(name)
        return np.array(var.get_tensor(), dtype=np.float64) if var is not None else np.zeros(1)


class FetchPrinter:
    """The seed's fetch printing, into the progress line and MLflow.

    ``train_from_dataset`` prints the fetched variables from C++ every ``print_period``
    batches of its first thread (``time: [...], batch: [N], loss[1]:[0.41]``) on standard
    output.  While it runs, standard output (file descriptor 1) goes into a pipe; each
    such line becomes metrics ``fetch_<name>`` (the mean of the printed values) and the
    rest (Paddle's own chatter) is dropped.
    """

    def __init__(self, reporter, print_period: int):
        self.reporter, self.print_period = reporter, print_period
        self.latest = {}
        self.lines = 0

    def __enter__(self):
        sys.stdout.flush()
        self._saved = os.dup(1)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.close(write_end)
        self._thread = threading.Thread(target=self._read, args=(read_end,), daemon=True,
                                        name="kspipe-fetch")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self._saved, 1)  # the pipe's last write end closes: the reader sees its end
        os.close(self._saved)
        self._thread.join()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as pipe:
            for line in pipe:
                values = parse_fetch_line(line)
                if values:
                    self.lines += 1
                    self.latest = values
                    self.reporter.metrics({f"fetch_{k}": v for k, v in values.items()},
                                          step=self.lines * self.print_period)


def parse_fetch_line(line: str) -> dict:
    """``{name: mean value}`` of one line of Paddle's fetch printing; ``{}`` for other lines."""
    match = FETCH_LINE.match(line.strip())
    if not match:
        return {}
    values = {}
    for name, numbers in FETCH_ITEM.findall(match.group(2)):
        try:
            values[name] = float(np.mean([float(x) for x in numbers.replace(",", " ").split()]))
        except ValueError:
            continue
    return values


def auc_from_histograms(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC from per-threshold counts of positives and negatives (the AUC op's state)."""
    pos, neg = pos.reshape(-1), neg.reshape(-1)
    if pos.sum() == 0 or neg.sum() == 0:
        return 0.5
    tp = np.concatenate([[0.0], np.cumsum(pos[::-1])])
    fp = np.concatenate([[0.0], np.cumsum(neg[::-1])])
    return float(np.sum((fp[1:] - fp[:-1]) * (tp[1:] + tp[:-1]) / 2) / (tp[-1] * fp[-1]))


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
    batches = python_batches(dataset.test_files, dataset.desc, dataset.batch_size,
                             dict(dataset.dense_width))
    seen, total = 0, dataset.test_counts.total if dataset.test_counts else 0
    with paddle.static.scope_guard(scope):
        for feed in batches:
            label = np.array(feed[dataset.label]).reshape(-1)
            feed = {k: v for k, v in feed.items() if k in test_feeds}
            (pred,) = executor.run(programs.test, feed=feed, fetch_list=[programs.pred],
                                   scope=scope)
            labels.append(label)
            scores.append(np.asarray(pred).reshape(-1))
            seen += len(label)
            reporter.progress("evaluate", seen, max(total, seen), {})
    y = np.concatenate(labels).astype(np.float64)
    p = np.clip(np.concatenate(scores), 1e-7, 1 - 1e-7)
    return {"test_auc": roc_auc(y, p),
            "test_logloss": float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))),
            "test_instances": int(len(y)), "test_ctr": float(y.mean())}


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
            (out,) = executor.run(pull, feed={slot: feed}, fetch_list=[lookup], scope=scope,
                                  return_numpy=False)
            rows.append(np.array(out).reshape(-1, cfg.ctr.embedding_dim)[:len(ids)])
        export.var(name).get_tensor().set(np.concatenate(rows).astype(np.float32), place)
    for var in programs.infer.list_vars():
        if var.persistable and var.name not in programs.tables:
            value = scope.find_var(var.name)
            if value is not None:
                export.var(var.name).get_tensor().set(np.array(value.get_tensor()), place)
    return export


# --- save ---------------------------------------------------------------------------


@hookimpl
def kspipe_save_inference_model(cfg, role, programs, executor, scope, dirname):
    from kspipe.builtin.inference import export

    return export(cfg, dirname, programs.infer, programs.infer_feeds, [programs.infer_pred],
                  executor, programs.export_scope or scope)
