"""The tasks Reptile adapts to: each drawn from a random stream of its own, images NCHW.

A task depends only on (seed, purpose, index), so a resumed run, a cluster and one process
draw the same tasks; each task's generator goes on to draw its inner batches.
"""

from __future__ import annotations

import numpy as np

from kspipe.fewshot.data import sample_task

# Keys of the per-purpose random streams: every task depends only on (seed, purpose, index).
TRAIN_STREAM, EVAL_TEST_STREAM, EVAL_TRAIN_STREAM, CURVE_STREAM = 1, 2, 3, 4


def nchw(images: np.ndarray) -> np.ndarray:
    """Images [N, H, W, C] as the programs take them, [N, C, H, W]."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


def training_task(cfg, classes: list, index: int) -> tuple:
    """Training task ``index`` of ``classes``: (support x, support y, its generator), with
    ``train.shots`` images per class and no queries."""
    rng = np.random.default_rng([cfg.seed, TRAIN_STREAM, index])
    t = sample_task(classes, cfg.task.ways, cfg.train.shots, 0, rng)
    return nchw(t.support_x), t.support_y, rng


def evaluation_task(cfg, classes: list, stream: int, index: int) -> tuple:
    """Task ``index`` of ``classes`` in ``stream``: (support x, support y, query x, query y,
    its generator), with ``task.shots`` support and ``eval.queries`` query images per class."""
    rng = np.random.default_rng([cfg.seed, stream, index])
    t = sample_task(classes, cfg.task.ways, cfg.task.shots, cfg.eval.queries, rng)
    return nchw(t.support_x), t.support_y, nchw(t.query_x), t.query_y, rng
