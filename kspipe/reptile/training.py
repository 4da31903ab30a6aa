"""The Reptile job on one worker: meta-training with its learning curve and checkpoints,
the final evaluation and the baseline's; or, with ``evaluate=``, the evaluation of a run's
checkpoints.
"""

from __future__ import annotations

import os
import time
from contextlib import closing

import numpy as np

from kspipe import checkpoint
from kspipe.checkpoint.incremental import start_from
from kspipe.checkpoint.schedule import Schedule
from kspipe.errors import ClusterError
from kspipe.fewshot.data import Prefetcher
from kspipe.files import user_path
from kspipe.process import stopping
from kspipe.reptile.evaluation import Evaluation
from kspipe.reptile.learner import ReptileLearner
from kspipe.reptile.tasks import CURVE_STREAM, EVAL_TEST_STREAM, EVAL_TRAIN_STREAM


def train_and_evaluate(learner: ReptileLearner) -> dict:
    """The whole Reptile job on this worker: meta-training with checkpoints, the final
    evaluation, then the baseline's (the model training started from).

    Worker w of W runs the global meta-iterations w, w+W, ...: round r is the
    meta-iterations rW .. rW+W-1, one on each worker.  Every worker checkpoints its state
    at the end of the rounds that cross ``train.checkpoint_every``, at those that end
    ``train.checkpoint_minutes`` of wall-clock time (:mod:`kspipe.checkpoint.schedule`:
    the same round on every worker) and at the end; the
    first worker measures the learning curve and, once every worker finished
    (``role.finish_training``), runs the final evaluation and the baseline's.
    ``tasks_per_s`` is every worker's tasks over the wall-clock time of the training
    phase, waits, curve points and checkpoints included.

    In one process a stop request (SIGTERM, Ctrl-C) waits for the meta-iteration under way,
    writes a checkpoint and then stops; ``resume=`` continues from it.
    """
    cfg, role, reporter = learner.cfg, learner.role, learner.reporter
    workers, first = role.worker_num(), role.is_first_worker()
    ckpt_dir = os.path.join(reporter.run_dir, "checkpoints")

    needed = cfg.task.shots + cfg.eval.queries
    learner.dataset.check_task(cfg.task.ways, max(cfg.train.shots, needed), needed)
    if first:
        reporter.say(evaluation_sizes(cfg))
    if not cfg.get("evaluate"):
        learner.warm_up()  # beside what follows
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

    # the model training starts from, evaluated once training is done: no worker waits
    # for it, and the first meta-iteration comes seconds after the command
    untrained = learner.state() if first and start_iter == 0 and cfg.eval.baseline else None
    with stopping.deferred(enabled=workers == 1), learner.writer:
        metrics = {}
        role.barrier_worker()  # the clock starts on every worker together
        started = time.perf_counter()
        trained, done = meta_train(learner, start_iter, ckpt_dir)
        role.finish_training(learner.scope)
        learner.run(learner.p.save_theta)
        if not resumed_at(learner.resumed_from, ckpt_dir, done):
            learner.save_checkpoint(ckpt_dir, done)
        seconds = time.perf_counter() - started

        fingerprints = role.all_gather(learner.fingerprint())
        if len(set(fingerprints)) > 1:  # the mode's exchange failed: no one model to evaluate
            raise ClusterError(
                f"the workers ended with different models (parameter sums "
                f"{', '.join(f'{f:.9g}' for f in fingerprints)})"
            )
        metrics.update(throughput(role, trained, seconds, cfg.train.meta_batch))
        if not first:
            return metrics
        metrics.update(final_evaluation(learner))
        if untrained is not None:
            metrics.update(baseline_evaluation(learner, untrained))
    if cfg.eval.interval:
        metrics.update(
            {
                "curve/train_accuracy": metrics["train_accuracy"],
                "curve/test_accuracy": metrics["test_accuracy"],
            }
        )
    reporter.metrics(metrics, cfg.train.meta_iters)
    return metrics


def resumed_at(resumed_from: str | None, ckpt_dir: str, done: int) -> bool:
    """Whether the run resumed from its own checkpoint of ``done`` meta-iterations: a job
    requeued after its training ended has nothing left to train, and keeps that checkpoint
    as it was rather than writing it again.  ``resumed_from``: the checkpoint it loaded at
    its start, by path (it may be pruned since: nothing here reads it again)."""
    if not resumed_from:
        return False
    own = os.path.join(ckpt_dir, f"checkpoint-{done:07d}")
    return os.path.abspath(resumed_from) == os.path.abspath(own)


def evaluation_sizes(cfg) -> str:
    """The tasks each evaluation of the run will adapt, said in one line before they cost:
    ``eval.tasks`` test tasks (the final evaluation's, and the baseline's when the run has
    one), ``eval.train_tasks`` training tasks, and ``eval.interval_tasks`` of each for every
    learning-curve point (with ``evaluate=``, test tasks at each earlier checkpoint)."""
    e = cfg.eval
    sizes = [f"final {e.tasks} test + {e.train_tasks} train"]
    if cfg.get("evaluate"):
        sizes.append(f"learning curve {e.interval_tasks} test at each earlier checkpoint")
    else:
        if e.baseline and not cfg.resume:
            sizes.append(f"baseline {e.tasks}")
        if e.interval and cfg.train.meta_iters > e.interval:
            sizes.append(
                f"learning curve {e.interval_tasks} + {e.interval_tasks} every "
                f"{e.interval} meta-iterations"
            )
    return "tasks per evaluation: " + ", ".join(sizes)


def meta_train(learner: ReptileLearner, start_iter: int, ckpt_dir: str) -> tuple[int, int]:
    """This worker's meta-iterations from ``start_iter``; returns (tasks trained, global
    meta-iterations done at the end).  The task sampler's thread stops when it returns or
    raises."""
    cfg, role, reporter = learner.cfg, learner.role, learner.reporter
    workers, index, first = role.worker_num(), role.worker_index(), role.is_first_worker()
    total = cfg.train.meta_iters
    rounds = -(-total // workers)
    todo = [r * workers + index for r in range(rounds) if r * workers + index >= start_iter]
    tasks_at_start = learner.tasks_done
    losses, shown = [], {}
    last_done = done = start_iter
    schedule = Schedule(cfg.train.checkpoint_every, cfg.train.checkpoint_minutes, start_iter, role)
    with closing(Prefetcher(learner.train_tasks, todo, depth=3)) as feed:
        started = time.perf_counter()
        try:
            for iteration, tasks in feed:
                losses.append(learner.meta_iteration(iteration, tasks))
                done = iteration - index + workers  # the end of this round
                rate = (
                    (learner.tasks_done - tasks_at_start)
                    * workers
                    / max(time.perf_counter() - started, 1e-9)
                )
                if cfg.train.inner_iters:  # without inner steps there is no loss (NaN)
                    shown["loss"] = float(np.mean(losses[-20:]))
                shown["tasks/s"] = rate
                reporter.progress("meta-train", min(done, total), total, shown)
                if (
                    first
                    and cfg.eval.interval
                    and done < total
                    and crossed(done, last_done, cfg.eval.interval)
                ):
                    curve_point(learner, done, losses, shown)
                if done < rounds * workers and schedule.due(done):
                    learner.save_checkpoint(ckpt_dir, done)
                learner.writer.check()  # a checkpoint that could not be written ends the run
                last_done = done
                stopping.check()
        except stopping.Preempted as stop:
            if stop.safe and workers == 1 and done > start_iter:  # one process: keep its work
                path = learner.save_checkpoint(ckpt_dir, done)
                reporter.say(f"stopped after meta-iteration {done}; checkpoint {path}")
            raise
    return learner.tasks_done - tasks_at_start, done


def curve_point(learner: ReptileLearner, done: int, losses: list, shown: dict) -> None:
    """The learning curve's point after ``done`` meta-iterations: train and test accuracy on
    ``eval.interval_tasks`` tasks each, and the mean loss since the last point."""
    cfg = learner.cfg
    (train_acc, _), (test_acc, _) = learner.evaluate_all(
        [
            Evaluation(
                learner.dataset.train, cfg.eval.interval_tasks, CURVE_STREAM, "curve (train)"
            ),
            Evaluation(learner.dataset.test, cfg.eval.interval_tasks, CURVE_STREAM, "curve (test)"),
        ]
    )
    shown["test acc"] = test_acc  # on the progress line from now on
    point = {"curve/train_accuracy": train_acc, "curve/test_accuracy": test_acc}
    if cfg.train.inner_iters:  # without inner steps there is no loss (NaN)
        point["meta_loss"] = float(np.mean(losses[-cfg.eval.interval :]))
    learner.reporter.metrics(point, done)


def crossed(done: int, last_done: int, every: int) -> bool:
    """Whether going from ``last_done`` to ``done`` iterations passed a multiple of ``every``."""
    return done // every > last_done // every


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
        out.update(
            {
                f"worker{i}/tasks_per_s": float(t / max(s, 1e-9))
                for i, (t, s) in enumerate(zip(tasks, times))
            }
        )
    return out


def evaluate_checkpoints(learner: ReptileLearner, source: str) -> dict:
    """Evaluate a trained model without training: the checkpoint ``source`` (or a run
    folder's newest) as a run's final evaluation, and its learning curve from every
    checkpoint kept beside it (``curve/test_accuracy`` at each one's meta-iteration)."""
    cfg, reporter = learner.cfg, learner.reporter
    final = checkpoint.latest(user_path(source), "evaluate")
    earlier = [
        path for path in sorted(checkpoint.checkpoints(os.path.dirname(final))) if path < final
    ]
    for path in earlier:
        iteration = learner.load_checkpoint(path, "evaluate")
        acc, _ = learner.evaluate(
            learner.dataset.test,
            cfg.eval.interval_tasks,
            CURVE_STREAM,
            f"curve (test) at {iteration}",
        )
        reporter.metrics({"curve/test_accuracy": acc}, iteration)
    iteration = learner.load_checkpoint(final, "evaluate")
    reporter.say(f"evaluating {final} (meta-iteration {iteration})")
    metrics = final_evaluation(learner)
    if earlier:
        metrics["curve/test_accuracy"] = metrics["test_accuracy"]
    metrics["evaluated_meta_iteration"] = iteration
    reporter.metrics(metrics, iteration)
    return metrics


def baseline_evaluation(learner: ReptileLearner, untrained: dict) -> dict:
    """The final evaluation's test accuracy of the model as training found it
    (``untrained``, of :meth:`~kspipe.reptile.adaptation.Adapter.state`: the initial
    model, or ``init_from``'s), recorded at meta-iteration 0."""
    cfg = learner.cfg
    with learner.holding(untrained):
        acc, ci = learner.evaluate(
            learner.dataset.test, cfg.eval.tasks, EVAL_TEST_STREAM, "baseline"
        )
    metrics = {"baseline_test_accuracy": acc, "baseline_test_accuracy_ci95": ci}
    learner.reporter.metrics(metrics, 0)
    return metrics


def final_evaluation(learner: ReptileLearner) -> dict:
    """Test accuracy on ``eval.tasks`` test tasks and train accuracy, with 95% half-widths."""
    cfg = learner.cfg
    (test, test_ci), (train, train_ci) = learner.evaluate_all(
        [
            Evaluation(learner.dataset.test, cfg.eval.tasks, EVAL_TEST_STREAM, "evaluate"),
            Evaluation(
                learner.dataset.train, cfg.eval.train_tasks, EVAL_TRAIN_STREAM, "evaluate (train)"
            ),
        ]
    )
    return {
        "test_accuracy": test,
        "test_accuracy_ci95": test_ci,
        "train_accuracy": train,
        "train_accuracy_ci95": train_ci,
    }
