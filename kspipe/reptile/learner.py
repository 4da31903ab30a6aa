"""Reptile's training loop over the programs of :mod:`kspipe.reptile.programs`.

One loop for every mode: after each local meta step the mode's ``parameter_sync``
combines the workers' theta (nothing locally, the servers' strategy, or the mean over
collective workers).
"""

from __future__ import annotations

import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kspipe import checkpoint, stopping
from kspipe.errors import ClusterError
from kspipe.files import user_path
from kspipe.incremental import start_from
from kspipe.fewshot.data import Prefetcher, sample_task
from kspipe.reptile.batched import tasks_together, thread_count, train_lanes
from kspipe.reptile.programs import ACC, inner_batches, meta_step_size, tail_split

# Keys of the per-purpose random streams: every task depends only on (seed, purpose, index).
TRAIN_STREAM, EVAL_TEST_STREAM, EVAL_TRAIN_STREAM, CURVE_STREAM = 1, 2, 3, 4


def nchw(images: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


class ReptileLearner:
    """Meta-trains and evaluates one Reptile model inside a Paddle scope."""

    def __init__(self, cfg, dataset, programs, executor, scope, reporter, role=None):
        self.cfg = cfg
        self.dataset = dataset
        self.p = programs
        self.exe = executor
        self.scope = scope
        self.reporter = reporter
        self.role = role
        self.tasks_done = 0
        train, evaluation = tasks_together(cfg)
        self.train_together = programs.batched.get(train)  # None: one task at a time
        self.eval_together = programs.batched.get(evaluation)
        self._lanes = [Lane(executor, scope)]  # the threads that evaluate groups of tasks
        self._train_sizes = train_lanes(cfg)  # [] when the meta-batch adapts in one thread
        self._train_lanes = None  # the threads that share the meta-batch, made when first used
        self._train_pool = None

    # --- running programs ---------------------------------------------------------

    def run(self, program, feed=None, fetch=()):
        return self._lanes[0].run(program, feed, fetch)

    def lanes(self, count: int) -> list:
        """``count`` lanes for evaluating groups of tasks at once: this learner's own, then
        lanes with child scopes of its scope that hold their own copies of the slot
        variables (and read theta and the optimiser state from the parent)."""
        while len(self._lanes) < count:
            self._lanes.append(self.new_lane(self.eval_together))
        return self._lanes[:count]

    def new_lane(self, together, own=()):
        """A lane for ``together``'s programs: a new executor and a child scope of this
        learner's that holds the slot variables and the variables ``own`` (the rest it reads
        from the parent)."""
        import paddle

        scope = self.scope.new_scope()
        # Programs look their variables up through the parent scope: what a lane writes is
        # created in its own scope first (typed, or an initialiser cannot size it), and so
        # are its feed and fetch holders.
        scope.var("feed")
        scope.var("fetch")
        for name in [v.name for v in together.startup.list_vars()] + list(own):
            scope.var(name).get_tensor()
        lane = Lane(paddle.static.Executor(self.exe.place), scope, together, own)
        lane.run(together.startup)
        return lane

    def train_lanes(self) -> list:
        """One lane per share of the meta-batch (``train.threads``); each gathers its tasks
        into its own accumulator and optimiser state, which :meth:`adapt_on_lanes` combines."""
        if self._train_lanes is None:
            self._train_lanes = []
            for size in self._train_sizes:
                together = self.p.batched[size]
                own = [v.name for v in together.gather.list_vars()
                       if v.persistable and not v.name.startswith(f"tasks{size}.")]
                self._train_lanes.append(self.new_lane(together, own))
        return self._train_lanes

    def initialize(self) -> None:
        """Run the startup programs and record theta."""
        self.run(self.p.startup)
        for together in self.p.batched.values():
            self.run(together.startup)
        self.run(self.p.save_theta)

    def adapt(self, x: np.ndarray, y: np.ndarray, batch: int, iterations: int,
              rng: np.random.Generator) -> float:
        """Inner loop: ``iterations`` steps on batches of (x, y); returns the last loss."""
        return self.steps(x, y, inner_batches(len(x), batch, iterations, rng,
                                              self.cfg.train.replacement))

    def steps(self, x: np.ndarray, y: np.ndarray, batches: list, foml: bool = False) -> float:
        """One inner step per batch of indices (weight decay first, if any); returns the last
        loss.  ``foml``: accumulate only the last step's change (first-order MAML)."""
        loss = float("nan")
        y = y.reshape(-1, 1)
        for k, idx in enumerate(batches):
            last = k == len(batches) - 1
            if last and foml:
                self.run(self.p.unaccumulate)
            if self.p.decay is not None:
                self.run(self.p.decay)
            fetch = [self.p.loss] if last else []
            out = self.run(self.p.train_program, {"x": x[idx], "y": y[idx]}, fetch)
            if fetch:
                loss = float(np.asarray(out[0]).mean())
        return loss

    def adapt_to_task(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> float:
        """A training task's inner loop, leaving in the accumulator what the algorithm's meta
        step moves theta by: the adapted weights (Reptile) or the last step's change (FOML,
        whose last step is on a tail of ``train.foml_tail`` images per class, if set)."""
        cfg = self.cfg.train
        if cfg.algorithm != "foml":
            loss = self.adapt(x, y, cfg.inner_batch, cfg.inner_iters, rng)
            self.run(self.p.accumulate)
            return loss
        if cfg.foml_tail:
            rest, tail = tail_split(y, cfg.foml_tail)
            batches = [rest[b] for b in inner_batches(len(rest), cfg.inner_batch,
                                                      cfg.inner_iters - 1, rng, cfg.replacement)]
            batches.append(tail)
        else:
            batches = inner_batches(len(x), cfg.inner_batch, cfg.inner_iters, rng,
                                    cfg.replacement)
        loss = self.steps(x, y, batches, foml=True)
        self.run(self.p.accumulate)
        return loss

    def adapt_together(self, together, tasks: list, batch: int, iterations: int,
                       lane=None) -> float:
        """The inner loops of ``tasks`` ((x, y, rng) each, as many as ``together`` holds)
        side by side, each from the model's current state, as :meth:`adapt` starts each
        one; the slots (of ``lane``, by default this learner's) then hold the adapted
        copies.  Returns the mean last loss."""
        run = (lane or self).run
        batches = [inner_batches(len(x), batch, iterations, rng, self.cfg.train.replacement)
                   for x, _, rng in tasks]
        run(together.spread)
        loss = float("nan")
        for k in range(iterations):
            if together.decay is not None:
                run(together.decay)
            feed = together.stack([x[b[k]] for (x, _, _), b in zip(tasks, batches)],
                                  [y[b[k]] for (_, y, _), b in zip(tasks, batches)])
            fetch = [together.loss] if k == iterations - 1 else []
            out = run(together.train_program, feed, fetch)
            if fetch:
                loss = float(np.asarray(out[0]).sum()) / len(tasks)
        return loss

    def adapt_on_lanes(self, tasks: list, lanes: list) -> float:
        """The meta-batch's tasks shared among ``lanes``, one thread each, each share side by
        side from the model's current state; then acc holds the sum of all the adapted
        weights and the optimiser state their mean, as one lane holding every task leaves
        them.  Returns the mean last loss."""
        cfg = self.cfg.train
        own = lanes[0].own  # the same names in every lane
        state = dict(zip(own, self.values(own)))
        for lane in lanes:  # each lane's copies start from the model's state, acc from 0
            for name, value in state.items():
                lane.set(name, np.zeros_like(value) if name.endswith(ACC) else value)
        shares, start = [], 0
        for lane in lanes:
            shares.append(tasks[start:start + lane.together.tasks])
            start += lane.together.tasks

        def adapt(lane, share):
            from paddle.base import core

            core.set_num_threads(1)
            loss = self.adapt_together(lane.together, share, cfg.inner_batch, cfg.inner_iters,
                                       lane)
            lane.run(lane.together.gather)
            return loss

        if self._train_pool is None:
            self._train_pool = ThreadPoolExecutor(len(lanes), "kspipe-lane")
        futures = [self._train_pool.submit(adapt, lane, share)
                   for lane, share in zip(lanes, shares)]
        losses = [f.result() for f in futures]
        total = len(tasks)
        for name in own:
            values = [lane.value(name) for lane in lanes]
            if name.endswith(ACC):
                combined = state[name] + sum(values)
            elif all(np.array_equal(v, values[0]) for v in values):
                combined = values[0]
            else:  # the mean over every task: each lane holds the mean over its share
                combined = sum(v.astype(np.float64) * lane.together.tasks
                               for v, lane in zip(values, lanes)) / total
            self._lanes[0].set(name, combined.astype(values[0].dtype))
        return float(sum(loss * len(share) for loss, share in zip(losses, shares)) / total)

    def values(self, names) -> list:
        """The values of variables ``names`` in the scope, as numpy arrays."""
        return [np.array(self.scope.find_var(n).get_tensor()) for n in names]

    def fingerprint(self) -> float:
        """The sum of every parameter (float64): equal on workers that hold one model."""
        return float(sum(np.sum(v, dtype=np.float64) for v in self.values(self.p.params)))

    def predict(self, x: np.ndarray) -> np.ndarray:
        (logits,) = self.run(self.p.forward, {"x": x}, [self.p.logits])
        return np.asarray(logits)

    def classify(self, support_x: np.ndarray, query_x: np.ndarray) -> np.ndarray:
        """The class of each query after adapting on the support set.

        Transductive (``eval.transductive``, the default): the queries form one batch, so
        batch norm shares their statistics.  Otherwise each query is classified alone, in a
        batch of the support images and itself (the reference implementation's
        non-transductive evaluation): nothing passes between queries.
        """
        return self.query_logits(support_x, query_x).argmax(axis=1)

    def query_logits(self, support_x: np.ndarray, query_x: np.ndarray) -> np.ndarray:
        """The logits :meth:`classify` decides by."""
        if self.cfg.eval.transductive:
            return self.predict(query_x)
        return np.stack([self.predict(np.concatenate([support_x, q[None]]))[-1]
                         for q in query_x])

    # --- meta-training ------------------------------------------------------------

    def train_tasks(self, iteration: int) -> list:
        """The meta-batch of training tasks of ``iteration`` (images NCHW).

        Task ``t = iteration * meta_batch + j`` draws from a stream keyed by ``t`` alone, so
        the tasks of W consecutive meta-iterations are those of one meta-iteration with a
        meta-batch W times larger: a cluster round is that larger meta-iteration.

        With ``train.batch_tasks`` the meta-batch adapts side by side, each task from theta
        and the optimiser's state at the start of the meta-iteration; the state then
        becomes the tasks' mean (one at a time, each task starts from the state the one
        before it left).  With plain gradient steps (``train.inner_optimizer=sgd``) there is
        no such state and both paths take the same steps.
        """
        cfg = self.cfg
        tasks = []
        for j in range(cfg.train.meta_batch):
            task = iteration * cfg.train.meta_batch + j
            rng = np.random.default_rng([cfg.seed, TRAIN_STREAM, task])
            t = sample_task(self.dataset.train, cfg.task.ways, cfg.train.shots, 0, rng)
            tasks.append((nchw(t.support_x), t.support_y, rng))
        return tasks

    def meta_iteration(self, iteration: int, tasks: list) -> float:
        """Adapt on each task from theta, apply the meta step, and let the mode combine
        theta across workers; returns the mean loss.

        W workers run the global meta-iterations of a round (``iteration // W``) side by
        side, and the meta step size anneals over the rounds, so a cluster whose exchange
        averages the workers' theta (sync, collective) takes the steps of one process whose
        meta-batch is the round's tasks together.
        """
        cfg = self.cfg.train
        losses = []
        if self._train_sizes and len(tasks) == sum(self._train_sizes):
            self.run(self.p.restore_theta)
            losses.append(self.adapt_on_lanes(tasks, self.train_lanes()))
        elif self.train_together is not None and len(tasks) == self.train_together.tasks:
            self.run(self.p.restore_theta)
            losses.append(self.adapt_together(self.train_together, tasks, cfg.inner_batch,
                                              cfg.inner_iters))
            self.run(self.train_together.gather)
        else:
            for x, y, rng in tasks:
                self.run(self.p.restore_theta)
                losses.append(self.adapt_to_task(x, y, rng))
        workers = self.role.worker_num() if self.role is not None else 1
        eps = meta_step_size(iteration // workers, -(-cfg.meta_iters // workers), cfg.meta_step,
                             cfg.meta_step_final)
        keep = 1.0 if cfg.algorithm == "foml" else 1.0 - eps  # FOML adds eps * mean change
        feed = {"meta_a": np.array([keep], np.float32),
                "meta_b": np.array([eps / len(tasks)], np.float32)}
        self.run(self.p.meta_update, feed)
        self.sync()
        self.tasks_done += len(tasks)
        return float(np.mean(losses))

    def sync(self) -> None:
        """The mode's exchange of the parameters; theta follows them."""
        if self.p.sync is not None and self.p.sync.changes_parameters:
            self.p.sync.step(self.scope)
            self.run(self.p.save_theta)

    # --- evaluation ---------------------------------------------------------------

    def evaluate(self, classes: list, num_tasks: int, stream: int, label: str) -> tuple:
        """Mean query accuracy over ``num_tasks`` fresh tasks, and its 95% half-width.

        Each task adapts from the current theta and optimiser state, which are restored
        afterwards, so evaluating changes nothing.  Transductive evaluation adapts
        ``eval.batch_tasks`` tasks side by side, to the same numbers.
        """
        cfg = self.cfg
        shots, queries = cfg.task.shots, cfg.eval.queries
        self.run(self.p.snapshot)

        def make(k):
            rng = np.random.default_rng([cfg.seed, stream, k])
            t = sample_task(classes, cfg.task.ways, shots, queries, rng)
            return nchw(t.support_x), t.support_y, nchw(t.query_x), t.query_y, rng

        accuracies = []
        together = self.eval_together
        feed = Prefetcher(make, range(num_tasks))
        lanes = self.lanes(thread_count(cfg.eval.threads)) if together is not None else []
        try:
            if len(lanes) > 1:
                groups = chunks(feed, together.tasks)
                for done, group_accuracies in self.groups_on_lanes(together, groups, lanes):
                    accuracies += group_accuracies
                    self.reporter.progress(label, done, num_tasks,
                                           {"accuracy": float(np.mean(accuracies))})
                    stopping.check()
            else:
                for group in chunks(feed, together.tasks if together is not None else 1):
                    stopping.check()
                    if together is not None:
                        accuracies += self.accuracies_together(together, [t for _, t in group])
                    else:
                        _, (sx, sy, qx, qy, rng) = group[0]
                        self.run(self.p.restore_snapshot)
                        self.adapt(sx, sy, cfg.eval.inner_batch, cfg.eval.inner_iters, rng)
                        accuracies.append(float(np.mean(self.classify(sx, qx) == qy)))
                    self.reporter.progress(label, group[-1][0] + 1, num_tasks,
                                           {"accuracy": float(np.mean(accuracies))})
        finally:
            feed.close()
            self.run(self.p.restore_snapshot)
        acc = np.array(accuracies)
        half = 1.96 * acc.std(ddof=1) / np.sqrt(len(acc)) if len(acc) > 1 else 0.0
        return float(acc.mean()), float(half)

    def groups_on_lanes(self, together, groups, lanes: list):
        """Adapt ``groups`` (lists of (index, task)) on ``lanes``, one thread each, with one
        math thread each; yields (tasks done, their accuracies) per group, in order.

        Threads, not oneDNN's math threads, are what use the cores here: Paddle lets go of
        the GIL while a program runs, and a few ms steps of small convolutions parallelise
        far better across tasks than inside one step (see BENCHMARKS.md).
        """
        free: queue.Queue = queue.Queue()
        for lane in lanes:
            free.put(lane)

        def adapt(lane, group):
            from paddle.base import core

            core.set_num_threads(1)
            try:
                return self.accuracies_together(together, [t for _, t in group], lane)
            finally:
                free.put(lane)

        pending = []
        with ThreadPoolExecutor(len(lanes), thread_name_prefix="kspipe-lane") as pool:
            try:
                for group in groups:
                    lane = free.get()
                    pending.append((group[-1][0] + 1, pool.submit(adapt, lane, group)))
                    while pending and (pending[0][1].done() or len(pending) >= len(lanes)):
                        done, future = pending.pop(0)
                        yield done, future.result()
                for done, future in pending:
                    yield done, future.result()
            finally:
                for _, future in pending:
                    future.cancel()

    def accuracies_together(self, together, tasks: list, lane=None) -> list:
        """The query accuracy of each of ``tasks`` (support x, y, query x, y, rng), adapted
        side by side (on ``lane``, by default this learner's); a short group is padded with
        copies of its last task."""
        cfg = self.cfg.eval
        padded = tasks + [tasks[-1]] * (together.tasks - len(tasks))
        self.adapt_together(together, [(sx, sy, rng) for sx, sy, _, _, rng in padded],
                            cfg.inner_batch, cfg.inner_iters, lane)
        (logits,) = (lane or self).run(together.forward,
                                       together.stack([qx for _, _, qx, _, _ in padded]),
                                       [together.logits])
        return [float(np.mean(np.asarray(logits)[t].argmax(axis=1) == qy))
                for t, (_, _, _, qy, _) in enumerate(tasks)]

    # --- checkpoints --------------------------------------------------------------

    def save_checkpoint(self, folder: str, iteration: int) -> str:
        """Write every persistable and the progress to ``folder/checkpoint-<iteration>``.

        In a cluster the first worker writes the model there; every other worker writes
        its own state (its inner optimiser's moments) to ``folder/worker-<i>/``, so a
        resumed cluster continues as the uninterrupted one would.  The others write theirs
        first: a checkpoint that ``resume=`` finds has every worker's state beside it, even
        when the job was stopped while they were writing.
        """
        index = self.role.worker_index() if self.role is not None else 0
        if self.role is not None:
            self.role.settle_tables()  # the job's parameters, as the servers hold them
            self.run(self.p.save_theta)
        if index:
            folder = os.path.join(folder, f"worker-{index}")

        def save():
            return checkpoint.save(self.p.train, self.scope, folder, iteration,
                                   {"meta_iteration": iteration, "tasks_done": self.tasks_done},
                                   self.cfg.train.keep_checkpoints, cfg=self.cfg)

        path = save() if index else None
        if self.role is not None and self.role.worker_num() > 1:
            self.role.barrier_worker()
        return path or save()

    def load_checkpoint(self, path: str, key: str = "resume") -> int:
        """Load a checkpoint (or the newest one in a folder); returns its meta-iteration.
        ``key`` is the setting that named ``path``, for the messages.

        A worker other than the first then loads its own state saved beside it, if any.
        """
        progress = checkpoint.load(self.p.train, self.scope, path, key)
        index = self.role.worker_index() if self.role is not None else 0
        if index:
            found = checkpoint.latest(user_path(path), key)
            own = os.path.join(os.path.dirname(found), f"worker-{index}",
                               os.path.basename(found))
            if os.path.isdir(own):
                progress = checkpoint.load(self.p.train, self.scope, own)
            else:
                self.reporter.say(f"worker {index}: no state of its own beside {found}; it "
                                  f"starts from the first worker's optimiser state")
        self.run(self.p.save_theta)
        self.tasks_done = progress["tasks_done"]
        return progress["meta_iteration"]


class Lane:
    """An executor and a scope to run programs in, one thread's own; for a lane that
    adapts tasks side by side, their programs and the variables it holds itself."""

    def __init__(self, executor, scope, together=None, own=()):
        self.exe = executor
        self.scope = scope
        self.together = together
        self.own = list(own)

    def run(self, program, feed=None, fetch=()):
        return self.exe.run(program, feed=feed or {}, fetch_list=list(fetch), scope=self.scope)

    def value(self, name: str) -> np.ndarray:
        return np.array(self.scope.find_var(name).get_tensor())

    def set(self, name: str, value: np.ndarray) -> None:
        self.scope.find_var(name).get_tensor().set(value, self.exe.place)


def chunks(items, size: int):
    """Lists of ``size`` consecutive ``items`` (the last one shorter)."""
    group = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def crossed(done: int, last_done: int, every: int) -> bool:
    """Whether going from ``last_done`` to ``done`` iterations passed a multiple of ``every``."""
    return done // every > last_done // every


def train_and_evaluate(learner: ReptileLearner) -> dict:
    """The whole Reptile job on this worker: baseline, meta-training with checkpoints,
    final evaluation.

    Worker w of W runs the global meta-iterations w, w+W, ...: round r is the
    meta-iterations rW .. rW+W-1, one on each worker.  Every worker checkpoints its state
    at the end of the rounds that cross ``train.checkpoint_every`` and at the end; the
    first worker measures the baseline and the learning curve and, once every worker
    finished (``role.finish_training``), runs the final evaluation.  ``tasks_per_s`` is
    every worker's tasks over the wall-clock time of the training phase, waits, curve
    points and checkpoints included.

    In one process a stop request (SIGTERM, Ctrl-C) waits for the meta-iteration under way,
    writes a checkpoint and then stops; ``resume=`` continues from it.
    """
    cfg, role, reporter = learner.cfg, learner.role, learner.reporter
    workers, first = role.worker_num(), role.is_first_worker()
    ckpt_dir = os.path.join(reporter.run_dir, "checkpoints")

    needed = cfg.task.shots + cfg.eval.queries
    learner.dataset.check_task(cfg.task.ways, max(cfg.train.shots, needed), needed)
    learner.initialize()
    if cfg.get("evaluate"):
        return evaluate_checkpoints(learner, cfg.evaluate)
    start_iter = 0
    if cfg.resume:
        start_iter = learner.load_checkpoint(cfg.resume)
        reporter.say(f"resuming from meta-iteration {start_iter} ({cfg.resume})")
    start = start_from(cfg, learner.p.train, learner.scope, reporter.run_dir, reporter)
    role.init_worker(learner.scope)
    start.load_tables(role)
    learner.run(learner.p.save_theta)

    with stopping.deferred(enabled=workers == 1):
        metrics = {}
        if first and start_iter == 0 and cfg.eval.baseline:
            acc, ci = learner.evaluate(learner.dataset.test, cfg.eval.tasks, EVAL_TEST_STREAM,
                                       "baseline")
            metrics.update(baseline_test_accuracy=acc, baseline_test_accuracy_ci95=ci)
            reporter.metrics({"baseline_test_accuracy": acc,
                              "baseline_test_accuracy_ci95": ci}, 0)
        role.barrier_worker()  # the clock starts on every worker together
        started = time.perf_counter()
        trained, done = meta_train(learner, start_iter, ckpt_dir)
        role.finish_training(learner.scope)
        learner.run(learner.p.save_theta)
        learner.save_checkpoint(ckpt_dir, done)
        seconds = time.perf_counter() - started

        fingerprints = role.all_gather(learner.fingerprint())
        if len(set(fingerprints)) > 1:  # the mode's exchange failed: no one model to evaluate
            raise ClusterError(f"the workers ended with different models (parameter sums "
                               f"{', '.join(f'{f:.9g}' for f in fingerprints)})")
        metrics.update(throughput(role, trained, seconds, cfg.train.meta_batch))
        if not first:
            return metrics
        metrics.update(final_evaluation(learner))
    if cfg.eval.interval:
        metrics.update({"curve/train_accuracy": metrics["train_accuracy"],
                        "curve/test_accuracy": metrics["test_accuracy"]})
    reporter.metrics(metrics, cfg.train.meta_iters)
    return metrics


def meta_train(learner: ReptileLearner, start_iter: int, ckpt_dir: str) -> tuple[int, int]:
    """This worker's meta-iterations from ``start_iter``; returns (tasks trained, global
    meta-iterations done at the end)."""
    cfg, role, reporter = learner.cfg, learner.role, learner.reporter
    workers, index, first = role.worker_num(), role.worker_index(), role.is_first_worker()
    total = cfg.train.meta_iters
    rounds = -(-total // workers)
    todo = [r * workers + index for r in range(rounds) if r * workers + index >= start_iter]
    feed = Prefetcher(learner.train_tasks, todo, depth=3)
    tasks_at_start = learner.tasks_done
    losses, shown = [], {}
    last_done = done = start_iter
    started = time.perf_counter()
    try:
        for iteration, tasks in feed:
            losses.append(learner.meta_iteration(iteration, tasks))
            done = iteration - index + workers  # the end of this round
            rate = (learner.tasks_done - tasks_at_start) * workers / max(
                time.perf_counter() - started, 1e-9)
            shown.update({"loss": float(np.mean(losses[-20:])), "tasks/s": rate})
            reporter.progress("meta-train", min(done, total), total, shown)
            if (first and cfg.eval.interval and done < total
                    and crossed(done, last_done, cfg.eval.interval)):
                train_acc, _ = learner.evaluate(learner.dataset.train, cfg.eval.interval_tasks,
                                                CURVE_STREAM, "curve (train)")
                test_acc, _ = learner.evaluate(learner.dataset.test, cfg.eval.interval_tasks,
                                               CURVE_STREAM, "curve (test)")
                shown["test acc"] = test_acc
                reporter.metrics({"curve/train_accuracy": train_acc,
                                  "curve/test_accuracy": test_acc,
                                  "meta_loss": float(np.mean(losses[-cfg.eval.interval:]))}, done)
            if (cfg.train.checkpoint_every and done < rounds * workers
                    and crossed(done, last_done, cfg.train.checkpoint_every)):
                learner.save_checkpoint(ckpt_dir, done)
            last_done = done
            stopping.check()
    except stopping.Preempted as stop:
        if stop.safe and workers == 1 and done > start_iter:  # one process: keep its work
            path = learner.save_checkpoint(ckpt_dir, done)
            reporter.say(f"stopped after meta-iteration {done}; checkpoint {path}")
        raise
    finally:
        feed.close()
    return learner.tasks_done - tasks_at_start, done


def throughput(role, trained: int, seconds: float, meta_batch: int) -> dict:
    """Tasks over the wall-clock time of the training phase: all workers' tasks over the
    slowest worker's time (their clocks start together); each worker's own rate too.
    Durations, not timestamps, cross the wire: the servers' gather is single precision."""
    tasks, times = role.all_gather(float(trained)), role.all_gather(float(seconds))
    out = {}
    if sum(tasks):
        wall = max(max(times), 1e-9)
        out["tasks_per_s"] = float(sum(tasks) / wall)
        out["meta_iters_per_s"] = float(sum(tasks) / wall / meta_batch)
    if len(tasks) > 1:
        out.update({f"worker{i}/tasks_per_s": float(t / max(s, 1e-9))
                    for i, (t, s) in enumerate(zip(tasks, times))})
    return out


def evaluate_checkpoints(learner: ReptileLearner, source: str) -> dict:
    """Evaluate a trained model without training: the checkpoint ``source`` (or a run
    folder's newest) as a run's final evaluation, and its learning curve from every
    checkpoint kept beside it (``curve/test_accuracy`` at each one's meta-iteration)."""
    cfg, reporter = learner.cfg, learner.reporter
    final = checkpoint.latest(user_path(source), "evaluate")
    earlier = [path for path in sorted(checkpoint.checkpoints(os.path.dirname(final)))
               if path < final]
    for path in earlier:
        iteration = learner.load_checkpoint(path, "evaluate")
        acc, _ = learner.evaluate(learner.dataset.test, cfg.eval.interval_tasks, CURVE_STREAM,
                                  f"curve (test) at {iteration}")
        reporter.metrics({"curve/test_accuracy": acc}, iteration)
    iteration = learner.load_checkpoint(final, "evaluate")
    reporter.say(f"evaluating {final} (meta-iteration {iteration})")
    metrics = final_evaluation(learner)
    if earlier:
        metrics["curve/test_accuracy"] = metrics["test_accuracy"]
    metrics["evaluated_meta_iteration"] = iteration
    reporter.metrics(metrics, iteration)
    return metrics


def final_evaluation(learner: ReptileLearner) -> dict:
    """Test accuracy on ``eval.tasks`` test tasks and train accuracy, with 95% half-widths."""
    cfg = learner.cfg
    acc, ci = learner.evaluate(learner.dataset.test, cfg.eval.tasks, EVAL_TEST_STREAM, "evaluate")
    out = {"test_accuracy": acc, "test_accuracy_ci95": ci}
    acc, ci = learner.evaluate(learner.dataset.train, cfg.eval.train_tasks, EVAL_TRAIN_STREAM,
                               "evaluate (train)")
    out.update(train_accuracy=acc, train_accuracy_ci95=ci)
    return out
