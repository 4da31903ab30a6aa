"""Training the click-through model with ``Executor.train_from_dataset`` (the successor
of AsyncExecutor): C++ threads read and parse the files, each thread trains Hogwild on its
own files, no Python in the data path.  A monitor and Paddle's own fetch printing bring
the progress into the progress line and MLflow.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import numpy as np

from kspipe import checkpoint
from kspipe.checkpoint.tables import MANIFEST, table_rows
from kspipe.ctr import metrics as ctr_metrics
from kspipe.errors import ConfigError
from kspipe.files import user_path

FETCH_LINE = re.compile(r"^time: \[[^\]]*\], batch: \[(\d+)\], (.*)$")
FETCH_ITEM = re.compile(r"([^\s,\[\]]+)\[\d+\]:\[([^\]]*)\]")


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
            f"aborts on {threads}: run with isolate=true (a process of its own)"
        )


def train(cfg, role, dataset, programs, executor, scope, reporter) -> dict:
    """``train_from_dataset`` over this worker's files, ``ctr.epochs`` times."""
    claim_threads(dataset.threads)
    epochs = cfg.ctr.epochs
    per_epoch = dataset.train_counts.total
    printer = FetchPrinter(reporter, cfg.datafeed.print_period)
    monitor = Monitor(
        programs, scope, reporter, per_epoch * epochs, cfg.datafeed.print_period_s, printer
    )
    names = list(programs.fetch)
    first_epoch = 0
    accumulators = [programs.stat_pos, programs.stat_neg, *programs.sums]
    totals = None  # the job's histograms and sums over every pass so far
    if cfg.resume:
        found = checkpoint.latest(user_path(cfg.resume))
        progress = checkpoint.load(programs.main, scope, cfg.resume)
        started = time.perf_counter()
        role.load_tables(os.path.join(found, checkpoint.TABLES), scope)
        first_epoch = progress["epoch"]
        printer.lines = progress.get("fetch_lines", 0)  # its steps go on from there
        if progress.get("metric_totals") is not None:
            totals = np.array(progress["metric_totals"], np.float64)
        monitor.done = progress.get("instances", 0)
        reporter.say(
            f"resumed after epoch {first_epoch} from {cfg.resume} (tables loaded in "
            f"{time.perf_counter() - started:.2f} s)"
        )
    reporter.say(
        f"training on {len(dataset.train_files)} file(s), {per_epoch} instances, "
        f"{dataset.threads} reader thread(s), epochs {first_epoch + 1}-{epochs}"
    )
    role.barrier_worker()  # the clock starts on every worker together
    started = time.perf_counter()
    writer = checkpoint.Writer()
    with writer:
        for epoch in range(first_epoch, epochs):
            files = make_dataset(dataset)
            with monitor, printer:
                executor.train_from_dataset(
                    program=programs.main,
                    dataset=files,
                    scope=scope,
                    thread=dataset.threads,
                    debug=bool(cfg.datafeed.profile),
                    fetch_list=list(programs.fetch.values()) or None,
                    fetch_info=names or None,
                    print_period=cfg.datafeed.print_period,
                )
            if dataset.kind == "in_memory":
                files.release_memory()
            monitor.report(epoch_done=epoch + 1)
            monitor.done = monitor.seen()  # its counts are zeroed for the next pass
            totals = pass_metrics(role, programs, scope, reporter, accumulators, epoch + 1, totals)
            if cfg.ctr.shrink:  # an epoch is a day here
                end_day(role, reporter)
            save_checkpoint(
                cfg,
                role,
                programs,
                scope,
                reporter,
                epoch + 1,
                writer,
                printer.lines,
                {"metric_totals": totals.tolist(), "instances": monitor.done},
            )
    seconds = time.perf_counter() - started
    job = ctr_metrics.metrics(totals) if totals is not None else {"auc": 0.5}
    samples = per_epoch * (epochs - first_epoch)
    # all workers' samples over the slowest worker's time: the job's rate, waits included
    everyone = np.array([samples, seconds], np.float64)
    total, slowest = np.zeros_like(everyone), np.zeros_like(everyone)
    role.all_reduce_worker(everyone, total, "sum")
    role.all_reduce_worker(everyone, slowest, "max")
    metrics = {f"train_{k}": v for k, v in job.items() if k != "auc"}
    metrics.pop("train_instances", None)  # this run's, below
    metrics |= {
        "train_auc": job["auc"],
        "samples_per_s": float(total[0] / max(slowest[1], 1e-9)),
        "worker_samples_per_s": samples / max(seconds, 1e-9),
        "train_instances": samples,
        "train_seconds": seconds,
    }
    metrics.update({f"fetch_{name}": value for name, value in printer.latest.items()})
    return metrics


def pass_metrics(role, programs, scope, reporter, accumulators, step: int, totals):
    """Every worker, at a pass's end: the job's metrics of the pass (every worker's
    histograms and sums added, :mod:`kspipe.ctr.metrics`), logged by the first worker as
    ``pass/<metric>`` at ``step``, and ``train_auc`` so far at the job's instances; each
    worker's accumulators start again from zero.  Returns the totals with the pass's."""
    state = ctr_metrics.local_state(scope, programs.stat_pos, programs.stat_neg, programs.sums)
    state = ctr_metrics.job_state(role, state)
    ctr_metrics.zero(scope, accumulators)
    totals = state if totals is None else totals + state
    if role.is_first_worker():
        found = ctr_metrics.metrics(state)
        reporter.metrics({f"pass/{k}": v for k, v in found.items()}, step=step)
        so_far = ctr_metrics.metrics(totals)
        reporter.metrics({"train_auc": so_far["auc"]}, step=so_far["instances"])
        shown = ", ".join(f"{k} {v:.4f}" for k, v in found.items() if k != "instances")
        reporter.say(f"pass {step}: {found['instances']} instances on every worker, {shown}")
    return totals


def end_day(role, reporter) -> None:
    """Every worker, at a day's end: the servers' tables age a day and shrink
    (``role.end_day_tables``), once every worker's updates are in."""
    role.settle_tables()
    if role.is_first_worker():
        started = time.perf_counter()
        role.end_day_tables(os.path.join(reporter.run_dir, "day-end-tables"))
        reporter.say(f"day's end: tables aged and shrunk in {time.perf_counter() - started:.2f} s")
    role.barrier_worker()


def save_checkpoint(
    cfg,
    role,
    programs,
    scope,
    reporter,
    epoch: int,
    writer=None,
    fetch_lines: int = 0,
    extra: dict | None = None,
) -> None:
    """Every worker calls it after an epoch: the first writes the checkpoint (with how many
    fetch lines were printed, so a resumed run's ``fetch_*`` steps go on), with the
    tables the mode keeps outside the workers (each server's shard) inside it, while the
    others wait; nobody pushes the next epoch's updates before the tables are written.
    The rest of the checkpoint (the dense state, copied) is written on ``writer``'s thread
    (:class:`kspipe.checkpoint.Writer`) while the next epoch trains.

    ctr checkpoints after every epoch: ``train_from_dataset`` trains a whole epoch in one
    C++ call, the smallest unit it gives back, so neither ``train.checkpoint_every`` nor
    ``train.checkpoint_minutes`` can place a checkpoint in between."""
    started = time.perf_counter()
    role.settle_tables()
    if role.is_first_worker():
        tables = []

        def save_tables(folder):
            began = time.perf_counter()
            role.save_tables(folder)
            tables.append(time.perf_counter() - began)
            if os.path.isfile(os.path.join(folder, MANIFEST)):  # the servers' tables
                rows = table_rows(folder)
                shown = {f"table/{name}/rows": count for name, count in rows.items()}
                reporter.metrics(shown | {"table/rows": sum(rows.values())}, step=epoch)

        path = checkpoint.save(
            programs.main,
            scope,
            os.path.join(reporter.run_dir, "checkpoints"),
            epoch,
            {"epoch": epoch, "fetch_lines": fetch_lines, **(extra or {})},
            cfg.train.keep_checkpoints,
            cfg=cfg,
            tables=save_tables,
            writer=writer,
        )
        reporter.say(
            f"checkpoint {path}: training waited {time.perf_counter() - started:.2f} s "
            f"(the servers' tables {sum(tables):.2f} s)"
        )
    role.barrier_worker()


def make_dataset(dataset):
    """A QueueDataset (streamed) or InMemoryDataset (loaded, shuffled) over the files."""
    import paddle

    if dataset.kind == "queue":
        files = paddle.distributed.QueueDataset()
    else:
        files = paddle.distributed.InMemoryDataset()
    files.init(
        batch_size=dataset.batch_size, thread_num=dataset.threads, use_var=[], pipe_command="cat"
    )
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
    them, with the printer's latest fetched values, in the progress line; ``worker_auc``
    is this worker's AUC of the pass so far (the job's, ``train_auc``, comes at each pass's
    end: :func:`pass_metrics`).
    """

    def __init__(self, programs, scope, reporter, total: int, period: float, printer):
        self.p, self.scope, self.reporter = programs, scope, reporter
        self.total, self.period, self.printer = total, period, printer
        self._stop = threading.Event()
        self._thread = None
        self.done = 0  # this worker's instances of the passes before (their counts zeroed)

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
        return self.done + int(
            self._read(self.p.stat_pos).sum() + self._read(self.p.stat_neg).sum()
        )

    def auc(self) -> float:
        return auc_from_histograms(self._read(self.p.stat_pos), self._read(self.p.stat_neg))

    def report(self, epoch_done: int | None = None) -> None:
        seen, auc = min(self.seen(), self.total), self.auc()
        shown = {"auc": auc, **self.printer.latest}
        if epoch_done:
            shown["epoch"] = epoch_done
        self.reporter.progress("train", seen, self.total, shown)
        self.reporter.metrics({"worker_auc": auc}, step=seen)  # this worker's, this pass

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
        self._thread = threading.Thread(
            target=self._read, args=(read_end,), daemon=True, name="kspipe-fetch"
        )
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
                    self.reporter.metrics(
                        {f"fetch_{k}": v for k, v in values.items()},
                        step=self.lines * self.print_period,
                    )


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
