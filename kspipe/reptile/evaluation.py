"""Evaluation: a model's mean query accuracy over fresh tasks, adapting one task at a time,
a group of tasks side by side, or such groups on several threads, to the same numbers."""

from __future__ import annotations

import queue
from concurrent.futures import wait
from contextlib import closing
from dataclasses import dataclass

import numpy as np

from kspipe.fewshot.data import Prefetcher
from kspipe.process import stopping
from kspipe.reptile.lanes import thread_count
from kspipe.reptile.tasks import evaluation_task


@dataclass(frozen=True)
class Evaluation:
    """``tasks`` fresh tasks of ``classes`` from task stream ``stream``, their progress
    shown under ``label``."""

    classes: list
    tasks: int
    stream: int
    label: str


def evaluate(model, together, reporter, evaluations: list) -> list[tuple]:
    """Mean query accuracy of ``model`` (an :class:`~kspipe.reptile.adaptation.Adapter`)
    over each of ``evaluations`` (:class:`Evaluation`), and its 95% half-width; the
    progress goes to ``reporter``.

    Each task adapts from the current theta and optimiser state, which are restored
    afterwards, so evaluating changes nothing.  With ``together`` (the programs of
    ``eval.batch_tasks`` tasks side by side; None: one task at a time) transductive
    evaluation adapts that many tasks at once, on ``eval.threads`` threads, to the same
    numbers.  The evaluations share the threads: a learning curve's point adapts its
    train and its test tasks at once, where one after the other would leave a core idle.
    """
    cfg = model.cfg
    model.run(model.p.snapshot)
    accuracies: list[list] = [[] for _ in evaluations]

    def make(key):
        which, k = key
        return evaluation_task(cfg, evaluations[which].classes, evaluations[which].stream, k)

    keys = [(which, k) for which, e in enumerate(evaluations) for k in range(e.tasks)]
    size = together.tasks if together is not None else 1
    try:
        with closing(Prefetcher(make, keys)) as feed:
            lanes = (
                model.lanes(thread_count(cfg.eval.threads), together)
                if together is not None
                else []
            )
            groups = chunks(feed, size)
            if lanes:  # two or more, each on its own thread
                adapted = groups_on_lanes(model, together, groups, lanes)
            else:
                adapted = groups_here(model, together, groups)
            with closing(adapted):
                for group, group_accuracies in adapted:
                    (which, _), _ = group[0]
                    accuracies[which] += group_accuracies
                    reporter.progress(
                        evaluations[which].label,
                        group[-1][0][1] + 1,
                        evaluations[which].tasks,
                        {"accuracy": float(np.mean(accuracies[which]))},
                    )
                    stopping.check()
    finally:
        model.run(model.p.restore_snapshot)
    return [mean_and_half_width(np.array(acc)) for acc in accuracies]


def mean_and_half_width(accuracies: np.ndarray) -> tuple[float, float]:
    """The mean of ``accuracies`` and its 95% half-width (0 for a single one)."""
    half = 1.96 * accuracies.std(ddof=1) / np.sqrt(len(accuracies)) if len(accuracies) > 1 else 0.0
    return float(accuracies.mean()), float(half)


def groups_here(model, together, groups):
    """Adapt ``groups`` (lists of (key, task)) on the job's thread, a stop request checked
    before each; yields (group, its accuracies) per group: side by side with ``together``,
    else each group's one task alone."""
    cfg = model.cfg.eval
    for group in groups:
        stopping.check()
        if together is not None:
            yield group, accuracies_together(model, together, [task for _, task in group])
            continue
        _, (sx, sy, qx, qy, rng) = group[0]
        model.run(model.p.restore_snapshot)
        model.adapt(sx, sy, cfg.inner_batch, cfg.inner_iters, rng)
        yield group, [float(np.mean(model.classify(sx, qx) == qy))]


def groups_on_lanes(model, together, groups, lanes: list):
    """Adapt ``groups`` (lists of (key, task)) on ``lanes``, each on its lane's thread;
    yields (group, its accuracies) per group, in order.  When it ends or is closed, the
    groups not started are dropped and those running are waited for."""
    free: queue.Queue = queue.Queue()
    for lane in lanes:
        free.put(lane)

    def adapt(lane, group):
        try:
            return accuracies_together(model, together, [t for _, t in group], lane)
        finally:
            free.put(lane)

    pending = []
    try:
        for group in groups:
            lane = free.get()
            pending.append((group, lane.submit(adapt, group)))
            while pending and (pending[0][1].done() or len(pending) >= len(lanes)):
                finished, future = pending.pop(0)
                yield finished, future.result()
        for finished, future in pending:
            yield finished, future.result()
    finally:
        for _, future in pending:
            future.cancel()
        wait([future for _, future in pending])


def accuracies_together(model, together, tasks: list, lane=None) -> list:
    """The query accuracy of each of ``tasks`` (support x, y, query x, y, rng), adapted
    side by side (on ``lane``, by default the model's own); a short group is padded with
    copies of its last task."""
    cfg = model.cfg.eval
    padded = tasks + [tasks[-1]] * (together.tasks - len(tasks))
    model.adapt_together(
        together,
        [(sx, sy, rng) for sx, sy, _, _, rng in padded],
        cfg.inner_batch,
        cfg.inner_iters,
        lane,
    )
    (logits,) = (lane or model.lane).run(
        together.forward, together.stack([qx for _, _, qx, _, _ in padded]), [together.logits]
    )
    return [
        float(np.mean(np.asarray(logits)[t].argmax(axis=1) == qy))
        for t, (_, _, _, qy, _) in enumerate(tasks)
    ]


def chunks(items, size: int):
    """Lists of ``size`` consecutive ``items``, ((evaluation, index), task) pairs, each of
    one evaluation (its last one shorter)."""
    group = []
    for item in items:
        if group and item[0][0] != group[0][0][0]:
            yield group
            group = []
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group
