"""Reptile's meta-iteration on one worker of its job, and that worker's checkpoints.

One loop for every mode: after each local meta step the mode's ``parameter_sync``
combines the workers' theta (nothing locally, the servers' strategy, or the mean over
collective workers).  The loop itself is :mod:`kspipe.reptile.training`.
"""

from __future__ import annotations

import os

import numpy as np

from kspipe import checkpoint
from kspipe.files import user_path
from kspipe.reptile import evaluation
from kspipe.reptile.adaptation import Adapter
from kspipe.reptile.batched import combine_lanes, lane_gather, lane_shares
from kspipe.reptile.lanes import (
    Lane,
    child_lane,
    results,
    run_on_lanes,
    start_on_lanes,
    tasks_together,
    train_lanes,
)
from kspipe.reptile.programs import inner_batches, meta_step_size, tail_split
from kspipe.reptile.tasks import training_task
from kspipe.role import Role


class ReptileLearner(Adapter):
    """Meta-trains and evaluates one Reptile model inside a Paddle scope, as the worker
    ``role`` of its job (None: a learner outside a job, as a test, a benchmark or a
    reference computation makes it: the one worker, :class:`kspipe.role.Role`)."""

    def __init__(self, cfg, dataset, programs, executor, scope, reporter, role=None):
        super().__init__(cfg, programs, executor, scope)
        self.dataset = dataset
        self.reporter = reporter
        self.role = role if role is not None else Role()
        self.tasks_done = 0
        self.resumed_from: str | None = None  # the checkpoint it loaded, by path
        in_training, self._in_evaluation = tasks_together(cfg)
        self.train_together = programs.batched.get(in_training)  # None: one task at a time
        self._train_sizes = train_lanes(cfg)  # [] when the meta-batch adapts in one thread
        self._train_lanes = None  # the lanes that share the meta-batch, made when first used
        self._gathering = None  # (each lane's gather, their combine), built when first used
        self._warming: list = []  # the lanes' first steps under way (warm_up)
        self.writer = checkpoint.Writer()  # the first worker's checkpoints, written aside

    @property
    def eval_together(self):
        """The programs evaluation adapts side by side with (None: one task at a time),
        built at the first evaluation."""
        return self.together(self._in_evaluation)

    def train_lanes(self) -> list:
        """One lane per share of the meta-batch (``train.threads``); each sums its tasks'
        adapted copies into shares of its own in the model's scope, which
        :meth:`adapt_on_lanes` then combines in one program."""
        if self._train_lanes is None:
            self._train_lanes = [
                child_lane(self.scope, self.exe.place, self.p.batched[size])
                for size in self._train_sizes
            ]
            for i, lane in enumerate(self._train_lanes):
                for name in lane_shares(lane.together, i):  # the model's scope holds them
                    self.scope.var(name).get_tensor()
        return self._train_lanes

    def warm_up(self) -> None:
        """Start each training lane's first step now, on blank images, while the job's
        thread prepares the rest: a program's first run is its costliest (~1 s: Paddle
        prepares it and oneDNN builds its kernels).  Only the lane's slots take the step,
        and every meta-iteration spreads the model's state over them first."""
        height, width, channels = self.dataset.image_shape
        batch = self.cfg.train.inner_batch
        for lane in self.train_lanes():
            together = lane.together
            feed = together.stack(
                [np.zeros((batch, channels, height, width), np.float32)] * together.tasks,
                [np.zeros((batch, 1), np.int64)] * together.tasks,
            )
            self._warming.append(lane.submit(Lane.run, together.train_program(lane.scope), feed))

    def gathering(self, lanes: list) -> tuple:
        """Each of ``lanes``' gather of its share (:func:`~kspipe.reptile.batched.lane_gather`)
        and the program that combines them (:func:`~kspipe.reptile.batched.combine_lanes`),
        built the first time (~0.7 s: the first meta-iteration builds them while the lanes
        adapt)."""
        if self._gathering is None:
            togethers = [lane.together for lane in lanes]
            self._gathering = (
                [lane_gather(t, i) for i, t in enumerate(togethers)],
                combine_lanes(togethers),
            )
        return self._gathering

    def close(self) -> None:
        """Stop every lane's thread (the learner is not used after)."""
        super().close()
        for lane in self._train_lanes or []:
            lane.close()

    def fingerprint(self) -> float:
        """The sum of every parameter (float64): equal on workers that hold one model."""
        return float(sum(np.sum(v, dtype=np.float64) for v in self.values(self.p.params)))

    def evaluate(self, classes: list, num_tasks: int, stream: int, label: str) -> tuple:
        """Mean query accuracy over ``num_tasks`` fresh tasks of ``classes``, and its 95%
        half-width, changing nothing (:func:`kspipe.reptile.evaluation.evaluate`)."""
        return self.evaluate_all([evaluation.Evaluation(classes, num_tasks, stream, label)])[0]

    def evaluate_all(self, evaluations: list) -> list[tuple]:
        """:meth:`evaluate` for each of ``evaluations``
        (:class:`~kspipe.reptile.evaluation.Evaluation`), at once."""
        return evaluation.evaluate(self, self.eval_together, self.reporter, evaluations)

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
        batch = self.cfg.train.meta_batch
        return [
            training_task(self.cfg, self.dataset.train, iteration * batch + j) for j in range(batch)
        ]

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
            losses.append(
                self.adapt_together(self.train_together, tasks, cfg.inner_batch, cfg.inner_iters)
            )
            self.run(self.train_together.gather)
        else:
            for x, y, rng in tasks:
                self.run(self.p.restore_theta)
                losses.append(self.adapt_to_task(x, y, rng))
        workers = self.role.worker_num()
        eps = meta_step_size(
            iteration // workers, -(-cfg.meta_iters // workers), cfg.meta_step, cfg.meta_step_final
        )
        keep = 1.0 if cfg.algorithm == "foml" else 1.0 - eps  # FOML adds eps * mean change
        feed = {
            "meta_a": np.array([keep], np.float32),
            "meta_b": np.array([eps / len(tasks)], np.float32),
        }
        self.run(self.p.meta_update, feed)
        self.sync()
        self.tasks_done += len(tasks)
        return float(np.mean(losses))

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
            batches = [
                rest[b]
                for b in inner_batches(
                    len(rest), cfg.inner_batch, cfg.inner_iters - 1, rng, cfg.replacement
                )
            ]
            batches.append(tail)
        else:
            batches = inner_batches(len(x), cfg.inner_batch, cfg.inner_iters, rng, cfg.replacement)
        loss = self.steps(x, y, batches, foml=True)
        self.run(self.p.accumulate)
        return loss

    def adapt_on_lanes(self, tasks: list, lanes: list) -> float:
        """The meta-batch's tasks shared among ``lanes`` (:meth:`train_lanes`), each share
        side by side on its lane's thread from the model's current state; then acc holds
        the sum of all the adapted weights and the optimiser state their mean, as one lane
        holding every task leaves them.  Returns the mean last loss."""
        cfg = self.cfg.train
        shares, start = [], 0
        for lane in lanes:
            shares.append(tasks[start : start + lane.together.tasks])
            start += lane.together.tasks

        def adapt(lane, share):
            return self.adapt_together(lane.together, share, cfg.inner_batch, cfg.inner_iters, lane)

        warming, self._warming = self._warming, []  # the lanes' first steps, if under way
        adapting = start_on_lanes(adapt, lanes, shares)
        try:
            gathers, combine = self.gathering(lanes)
        finally:
            losses = results(warming + adapting)[len(warming) :]
        run_on_lanes(Lane.run, lanes, gathers)
        self.run(combine)
        return float(sum(loss * len(share) for loss, share in zip(losses, shares)) / len(tasks))

    def sync(self) -> None:
        """The mode's exchange of the parameters; theta follows them."""
        if self.p.sync is not None and self.p.sync.changes_parameters:
            self.p.sync.step(self.scope)
            self.run(self.p.save_theta)

    # --- checkpoints --------------------------------------------------------------

    def save_checkpoint(self, folder: str, iteration: int) -> str:
        """Write every persistable and the progress to ``folder/checkpoint-<iteration>``.

        In a cluster the first worker writes the model there; every other worker writes
        its own state (its inner optimiser's moments) to ``folder/worker-<i>/``, so a
        resumed cluster continues as the uninterrupted one would.  The others write theirs
        first, whole: a checkpoint that ``resume=`` finds has every worker's state beside
        it, even when the job was stopped while they were writing.  The first worker's
        files are written on :attr:`writer`'s thread while training goes on (training
        waits for the copy of the state only; ``with learner.writer:`` around training
        waits for them at its end).
        """
        index = self.role.worker_index()
        self.role.settle_tables()  # the job's parameters, as the servers hold them
        self.run(self.p.save_theta)
        follows = None
        if index:
            folder, follows = os.path.join(folder, f"worker-{index}"), folder

        def save(writer=None):
            return checkpoint.save(
                self.p.train,
                self.scope,
                folder,
                iteration,
                {"meta_iteration": iteration, "tasks_done": self.tasks_done},
                self.cfg.train.keep_checkpoints,
                cfg=self.cfg,
                writer=writer,
                follows=follows,
            )

        path = save() if index else None
        if self.role.worker_num() > 1:
            self.role.barrier_worker()
        return path or save(self.writer)

    def load_checkpoint(self, path: str, key: str = "resume") -> int:
        """Load a checkpoint (or the newest one in a folder); returns its meta-iteration.
        ``key`` is the setting that named ``path``, for the messages.

        A worker other than the first then loads its own state saved beside it, if any.
        """
        progress = checkpoint.load(self.p.train, self.scope, path, key)
        found = self.resumed_from = checkpoint.latest(user_path(path), key)
        index = self.role.worker_index()
        if index:
            own = os.path.join(os.path.dirname(found), f"worker-{index}", os.path.basename(found))
            if os.path.isdir(own):
                progress = checkpoint.load(self.p.train, self.scope, own)
            else:
                self.reporter.say(
                    f"worker {index}: no state of its own beside {found}; it "
                    f"starts from the first worker's optimiser state"
                )
        self.run(self.p.save_theta)
        self.tasks_done = progress["tasks_done"]
        return progress["meta_iteration"]
