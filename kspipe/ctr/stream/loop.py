"""Day-by-day training over PaddleRec's online layout (``ctr.stream``).

For each day from ``start_day`` to ``end_day``, each pass (:mod:`.layout`) in order:

1. every worker takes its share of the pass's lines (line ``k`` to worker
   ``k % workers``), written as MultiSlot files, one per reader thread;
2. from the second pass on, the model is first evaluated on them (progressive
   validation: data it has not trained on), every worker on its share, the metrics the
   job's (``pass/test_auc`` ... at the pass's number);
3. the pass trains once over them (``train_from_dataset``), and logs ``pass/auc`` ...;
4. every ``save_delta_frequency`` passes, a delta save (:mod:`.saves`).

A day ends with the eviction (its rows age a day, shrink, decay) and a base save.  A pass
whose folders hold no file is skipped in one line and given no number; the passes are
numbered from 1 over the stream.  ``resume=`` (and a restart) goes on at the pass after
the last whole save, its tables rebuilt from its base and deltas, and a day's end it had
not saved done again.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np

from kspipe import checkpoint
from kspipe.ctr import metrics as ctr_metrics
from kspipe.ctr.stream import layout, saves
from kspipe.ctr.training import claim_threads, end_day, make_dataset, pass_metrics
from kspipe.datafeed.files import format_line, parse_line, python_batches
from kspipe.files import user_path

#: A stream's saves are pruned by the stream (:func:`saves.prune`), not by count.
KEEP_ALL = 10**9


class Stream:
    """One worker's stream: where it is, what it has measured."""

    def __init__(self, cfg, role, dataset, programs, executor, scope, reporter):
        self.cfg, self.s, self.role, self.dataset = cfg, cfg.ctr.stream, role, dataset
        self.programs, self.executor, self.scope = programs, executor, scope
        self.reporter, self.run_dir = reporter, reporter.run_dir
        self.folder = os.path.join(self.run_dir, "checkpoints")
        self.data = os.path.join(self.run_dir, "stream-data", f"worker-{role.worker_index()}")
        self.accumulators = [programs.stat_pos, programs.stat_neg, *programs.sums]
        self.held = saves.HeldRows()
        self.done = 0  # passes in the tables (resumed: the save's)
        self.ended_day = ""  # the last day whose end is in the tables
        self.totals = None  # the job's histograms and sums over every pass trained
        self.test: dict = {}  # the last progressive validation's metrics
        self.samples = 0  # this worker's instances trained by this run
        self.seconds = {"train": 0.0, "delta": 0.0, "base": 0.0}

    # --- the stream ---------------------------------------------------------------

    def run(self) -> dict:
        claim_threads(self.dataset.threads)
        if self.cfg.resume:
            self.restore()
        elif self.cfg.get("init_from"):  # its first base: the model it starts from
            self.save(0, "base")
        self.role.barrier_worker()
        started = time.perf_counter()
        number = 0
        for day in layout.days(self.s):
            absent = []
            for p in layout.passes(self.s, day):
                if self.s.donefile is None and not layout.present(self.s, p):
                    absent.append(p.folders[0])
                    continue
                files = layout.files(self.s, p)
                if not files:
                    self.reporter.say(f"pass {p.span}: its folders hold no file, skipped")
                    continue
                number += 1
                if number > self.done:
                    self.one_pass(number, p, files)
            if absent:
                self.reporter.say(
                    f"day {day}: {len(absent)} pass(es) with no folder ({absent[0]}...), skipped"
                )
            if day > self.ended_day:
                self.end_of_day(day, number)
        return self.final(time.perf_counter() - started)

    def one_pass(self, number: int, p, files: list) -> None:
        lines = self.my_share(files)
        if number > 1:
            self.validate(number)
        began = time.perf_counter()
        if lines:
            self.train()
        self.seconds["train"] += time.perf_counter() - began
        self.samples += lines
        self.totals = pass_metrics(
            self.role,
            self.programs,
            self.scope,
            self.reporter,
            self.accumulators,
            number,
            self.totals,
        )
        self.done = number
        if number % self.s.save_delta_frequency == 0:
            self.save(number, "delta")

    def end_of_day(self, day: str, number: int) -> None:
        end_day(self.role, self.reporter)
        self.ended_day = day
        self.save(number, "base")

    # --- data -------------------------------------------------------------------

    def my_share(self, files: list) -> int:
        """This worker's lines of ``files`` as MultiSlot files in its own folder, one per
        reader thread (Paddle keeps a process's thread count); returns the lines."""
        from kspipe.datafeed.formats import lines_as_multislot

        d, desc = self.cfg.datafeed, self.dataset.desc
        workers, me, threads = (
            self.role.worker_num(),
            self.role.worker_index(),
            self.dataset.threads,
        )
        shutil.rmtree(self.data, ignore_errors=True)
        os.makedirs(self.data)
        paths = [os.path.join(self.data, f"part-{t:03d}") for t in range(threads)]
        outs = [open(path, "w") for path in paths]
        k = mine = 0
        try:
            for path in files:
                if d.format == "multislot":
                    values = multislot_lines(path, desc, self.dataset.dense_width)
                else:
                    values = lines_as_multislot(path, d.format, desc, d.label, d.label_slot)
                for row in values:
                    if k % workers == me:
                        outs[mine % threads].write(format_line(row, desc.slots) + "\n")
                        mine += 1
                    k += 1
        finally:
            for out in outs:
                out.close()
        self.dataset.train_files = paths
        return mine

    def train(self) -> None:
        files = make_dataset(self.dataset)
        self.executor.train_from_dataset(
            program=self.programs.main,
            dataset=files,
            scope=self.scope,
            thread=self.dataset.threads,
            debug=False,
        )
        if self.dataset.kind == "in_memory":
            files.release_memory()

    def validate(self, number: int) -> None:
        """Every worker: the model, before it trains on the pass, scores its share; the
        job's metrics logged as ``pass/test_<metric>`` at ``number``."""
        import paddle

        p, ds = self.programs, self.dataset
        feeds = set(p.test.global_block().vars) & set(p.feed_names)
        labels, scores = [np.zeros(0)], [np.zeros(0)]
        # an executor of its own each time: one that ran the program before a
        # train_from_dataset keeps the scope's feed variable as it was (a crash: SIGSEGV, or
        # "Variable Id ... is not registered" in the feed op)
        executor = paddle.static.Executor(paddle.CPUPlace())
        with paddle.static.scope_guard(self.scope):
            for feed in python_batches(ds.train_files, ds.desc, ds.batch_size, ds.dense_width):
                labels.append(np.array(feed[ds.label], np.float64).reshape(-1))
                feed = {k: v for k, v in feed.items() if k in feeds}
                (pred,) = executor.run(p.test, feed=feed, fetch_list=[p.pred], scope=self.scope)
                scores.append(np.asarray(pred, np.float64).reshape(-1))
        buckets = np.array(self.scope.find_var(p.stat_pos).get_tensor()).size
        state = prediction_state(np.concatenate(labels), np.concatenate(scores), buckets)
        found = ctr_metrics.metrics(ctr_metrics.job_state(self.role, state))
        self.test = {"test_auc": found["auc"], "test_logloss": found.get("logloss")}
        self.test |= {"test_copc": found.get("copc"), "test_instances": found["instances"]}
        if self.role.is_first_worker():
            shown = {f"pass/test_{k}": v for k, v in found.items() if v is not None}
            self.reporter.metrics(shown, step=number)
            self.reporter.say(
                f"pass {number}, before training on it: {found['instances']} instances, "
                f"auc {found['auc']:.4f}, logloss {found.get('logloss', float('nan')):.4f}"
            )

    # --- saves ------------------------------------------------------------------

    def save(self, number: int, kind: str) -> None:
        """Every worker: the tables settled, the first worker writes the save (a delta or
        a base) while the others wait."""
        self.role.settle_tables()
        if self.role.is_first_worker():
            began = time.perf_counter()
            mode = saves.DELTA_MODE if kind == "delta" else saves.BASE_MODE
            progress = {
                "pass": number,
                "kind": kind,
                "ended_day": self.ended_day,
                "metric_totals": None if self.totals is None else self.totals.tolist(),
                "test": self.test,
            }
            counted = {}

            def tables(folder):
                self.role.save_tables(folder, mode)
                counted.update(self.held.add(folder, base=kind == "base"))

            path = checkpoint.save(
                self.programs.main,
                self.scope,
                self.folder,
                number,
                progress,
                KEEP_ALL,
                cfg=self.cfg,
                tables=tables,
            )
            seconds = time.perf_counter() - began
            self.seconds[kind] += seconds
            if kind == "base":
                saves.prune(self.folder)
            shown = {f"table/{name}/rows": n for name, n in counted.items()}
            shown |= {"table/rows": sum(counted.values()), f"save/{kind}_seconds": seconds}
            self.reporter.metrics(shown, step=number)
            self.reporter.say(
                f"{kind} {os.path.basename(path)} after pass {number} in {seconds:.2f} s; "
                f"tables hold {sum(counted.values())} rows"
            )
            if self.s.dump_tables:
                name = f"pass-{number}" if kind == "delta" else f"base-{self.ended_day}"
                self.dump(name if number else "start")
        self.role.barrier_worker()

    def dump(self, name: str) -> None:
        target = os.path.join(self.run_dir, "stream-tables", name)
        shutil.rmtree(target, ignore_errors=True)
        self.role.save_tables(target)

    def restore(self) -> None:
        """Every worker: the tables of the last whole save (its base and deltas merged),
        the workers' state and where the stream was."""
        found = saves.intact(user_path(self.cfg.resume), self.reporter.say)
        progress = checkpoint.load(self.programs.main, self.scope, found)
        merged = os.path.join(self.run_dir, "restored-tables")
        began = time.perf_counter()
        if self.role.is_first_worker():
            saves.rebuild(found, merged)
        self.role.barrier_worker()
        self.role.load_tables(merged, self.scope)
        if self.role.is_first_worker():
            self.held.restore(merged)
        self.role.barrier_worker()  # every worker has read its manifest
        if self.role.is_first_worker():
            shutil.rmtree(merged, ignore_errors=True)
        self.done, self.ended_day = progress["pass"], progress.get("ended_day", "")
        if progress.get("metric_totals") is not None:
            self.totals = np.array(progress["metric_totals"], np.float64)
        self.test = progress.get("test") or {}
        links = saves.chain(found)
        self.reporter.say(
            f"resumed after pass {self.done} from {os.path.basename(found)}: tables rebuilt "
            f"from {os.path.basename(links[0])} and {len(links) - 1} later save(s) in "
            f"{time.perf_counter() - began:.2f} s"
        )
        if self.s.dump_tables and self.role.is_first_worker():
            self.dump(f"restored-{self.done}")
        self.role.barrier_worker()

    # --- the end ----------------------------------------------------------------

    def final(self, seconds: float) -> dict:
        everyone = np.array([self.samples, seconds], np.float64)
        total, slowest = np.zeros_like(everyone), np.zeros_like(everyone)
        self.role.all_reduce_worker(everyone, total, "sum")
        self.role.all_reduce_worker(everyone, slowest, "max")
        job = ctr_metrics.metrics(self.totals) if self.totals is not None else {"auc": 0.5}
        metrics = {f"train_{k}": v for k, v in job.items() if k != "instances"}
        metrics |= {
            "passes": self.done,
            "samples_per_s": float(total[0] / max(slowest[1], 1e-9)),
            "train_instances": self.samples,
            "train_seconds": seconds,
            "delta_save_seconds": self.seconds["delta"],
            "base_save_seconds": self.seconds["base"],
        }
        metrics |= {k: v for k, v in self.test.items() if v is not None}
        return metrics


def run(cfg, role, dataset, programs, executor, scope, reporter) -> dict:
    return Stream(cfg, role, dataset, programs, executor, scope, reporter).run()


def last_save(run_dir: str) -> str:
    """The stream's last save in ``run_dir`` (after its last day's end: a base)."""
    return checkpoint.latest(os.path.join(run_dir, "checkpoints"))


def multislot_lines(path: str, desc, widths: dict):
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield parse_line(line, desc.slots, dict(widths), path, number)


def prediction_state(labels: np.ndarray, scores: np.ndarray, buckets: int) -> np.ndarray:
    """The state vector of :mod:`kspipe.ctr.metrics` (the AUC op's histograms of
    ``buckets`` thresholds, then its sums) of ``scores`` against ``labels``."""
    p = np.asarray(scores, np.float64)
    y = np.asarray(labels, np.float64)
    index = np.clip((p * (buckets - 1)).astype(np.int64), 0, buckets - 1)
    pos = np.bincount(index[y > 0.5], minlength=buckets).astype(np.float64)
    neg = np.bincount(index[y <= 0.5], minlength=buckets).astype(np.float64)
    clipped = np.clip(p, 1e-7, 1 - 1e-7)
    loss = -(y * np.log(clipped) + (1 - y) * np.log(1 - clipped))
    sums = [len(y), y.sum(), p.sum(), np.abs(p - y).sum(), np.square(p - y).sum(), loss.sum()]
    return np.concatenate([pos, neg, np.array(sums, np.float64)])
