"""How many tasks adapt side by side, and on how many lanes: the sizes of the programs
:mod:`kspipe.reptile.batched` builds, from the config and the cores a process may use."""

from __future__ import annotations

import os


def tasks_together(cfg) -> tuple[int, int]:
    """How many tasks adapt side by side (1: one at a time): in meta-training, the
    meta-batch with ``train.batch_tasks`` under Reptile (FOML's last-step change stays on
    the per-task path); in evaluation, ``eval.batch_tasks`` test tasks, but no more than
    an evaluation has, when transductive (a lone query's batch stays on the per-task path).
    """
    batch_train = cfg.train.batch_tasks and cfg.train.algorithm == "reptile"
    train = cfg.train.meta_batch if batch_train else 1
    most = max(cfg.eval.tasks, cfg.eval.train_tasks, cfg.eval.interval_tasks)
    evaluation = min(cfg.eval.batch_tasks, most) if cfg.eval.transductive else 1
    return train, evaluation


#: The cores a process of a cluster may use, set by its launcher (Paddle sets OMP_NUM_THREADS
#: to 1 in every process that imports it, so that cannot tell).
THREADS_ENV = "KSPIPE_THREADS"


def thread_count(setting: int) -> int:
    """``train.threads`` / ``eval.threads``, or with 0 the cores this process is meant to
    use: its share where a cluster's launcher divided the cores among its workers, else
    every core it may run on."""
    if setting:
        return setting
    try:
        return max(1, int(os.environ.get(THREADS_ENV, "")))
    except ValueError:
        return max(1, len(os.sched_getaffinity(0)))


def train_lanes(cfg) -> list[int]:
    """The meta-batch's share of each thread that adapts it (``train.threads``), at least
    two tasks each; [] when it adapts in one thread."""
    train, _ = tasks_together(cfg)
    lanes = min(thread_count(cfg.train.threads), train // 2)
    if lanes <= 1:
        return []
    return [train // lanes + (1 if i < train % lanes else 0) for i in range(lanes)]


def train_sizes(cfg) -> list[int]:
    """The task counts meta-training adapts side by side: each lane's share, or the whole
    meta-batch (1: one task at a time)."""
    return train_lanes(cfg) or [tasks_together(cfg)[0]]


def program_sizes(cfg) -> set[int]:
    """The task counts to build side-by-side programs for."""
    return (set(train_sizes(cfg)) | {tasks_together(cfg)[1]}) - {1}
