"""Evaluation: a model's mean query accuracy over fresh tasks, adapting one task at a time,
a group of tasks side by side, or such groups on several threads, to the same numbers."""

from __future__ import annotations

import queue
from concurrent.futures import wait
from contextlib import closing

import numpy as np

from kspipe import stopping
from kspipe.fewshot.data import Prefetcher
from kspipe.reptile.batched import thread_count
from kspipe.reptile.tasks import evaluation_task


def evaluate(model, together, reporter, classes: list, num_tasks: int, stream: int,
             label: str) -> tuple:
    """Mean query accuracy of ``model`` (an :class:`~kspipe.reptile.adaptation.Adapter`)
    over ``num_tasks`` fresh tasks of ``classes``, and its 95% half-width; the progress
    goes to ``reporter`` under ``label``.

    Each task adapts from the current theta and optimiser state, which are restored
    afterwards, so evaluating changes nothing.  With ``together`` (the programs of
    ``eval.batch_tasks`` tasks side by side; None: one task at a time) transductive
    evaluation adapts that many tasks at once, on ``eval.threads`` threads, to the same
    numbers.
    """
    cfg = model.cfg
    model.run(model.p.snapshot)
    accuracies = []
    try:
        with closing(Prefetcher(lambda k: evaluation_task(cfg, classes, stream, k),
                                range(num_tasks))) as feed:
            lanes = (model.lanes(thread_count(cfg.eval.threads), together)
                     if together is not None else [])
            if lanes:  # two or more, each on its own thread
                groups = chunks(feed, together.tasks)
                with closing(groups_on_lanes(model, together, groups, lanes)) as results:
                    for done, group_accuracies in results:
                        accuracies += group_accuracies
                        reporter.progress(label, done, num_tasks,
                                          {"accuracy": float(np.mean(accuracies))})
                        stopping.check()
            else:
                for group in chunks(feed, together.tasks if together is not None else 1):
                    stopping.check()
                    if together is not None:
                        accuracies += accuracies_together(model, together,
                                                          [t for _, t in group])
                    else:
                        _, (sx, sy, qx, qy, rng) = group[0]
                        model.run(model.p.restore_snapshot)
                        model.adapt(sx, sy, cfg.eval.inner_batch, cfg.eval.inner_iters, rng)
                        accuracies.append(float(np.mean(model.classify(sx, qx) == qy)))
                    reporter.progress(label, group[-1][0] + 1, num_tasks,
                                      {"accuracy": float(np.mean(accuracies))})
    finally:
        model.run(model.p.restore_snapshot)
    acc = np.array(accuracies)
    half = 1.96 * acc.std(ddof=1) / np.sqrt(len(acc)) if len(acc) > 1 else 0.0
    return float(acc.mean()), float(half)


def groups_on_lanes(model, together, groups, lanes: list):
    """Adapt ``groups`` (lists of (index, task)) on ``lanes``, each on its lane's thread;
    yields (tasks done, their accuracies) per group, in order.  When it ends or is closed,
    the groups not started are dropped and those running are waited for."""
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
            pending.append((group[-1][0] + 1, lane.submit(adapt, group)))
            while pending and (pending[0][1].done() or len(pending) >= len(lanes)):
                done, future = pending.pop(0)
                yield done, future.result()
        for done, future in pending:
            yield done, future.result()
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
    model.adapt_together(together, [(sx, sy, rng) for sx, sy, _, _, rng in padded],
                         cfg.inner_batch, cfg.inner_iters, lane)
    (logits,) = (lane or model.lane).run(together.forward,
                                         together.stack([qx for _, _, qx, _, _ in padded]),
                                         [together.logits])
    return [float(np.mean(np.asarray(logits)[t].argmax(axis=1) == qy))
            for t, (_, _, _, qy, _) in enumerate(tasks)]


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
