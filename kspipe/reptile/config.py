"""Reptile's config groups, ``task``, ``model``, ``train`` and ``eval``, and their defaults.

Each dataclass is the schema of its group, which the plugin declares with
``kspipe_config_schemas`` (:mod:`kspipe.reptile.plugin`), so a misspelt key
(``train.meta_iter``) or a value of the wrong type (``train.meta_iters=abc``) is refused
while Hydra composes the config.
Ranges (``train.meta_batch >= 1`` ...) are the plugin's ``kspipe_check_config``.

The evaluations' other task counts follow ``eval.tasks`` up to a bound
(``${kspipe_min:...}``, :data:`kspipe.config.schema.MIN_RESOLVER`): ``eval.tasks=5`` alone makes
every evaluation of a quick run small, and a value given for one of them replaces its bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TaskConfig:
    """A few-shot task: ``ways`` classes with ``shots`` support images each."""

    ways: int = 5  # classes per task
    shots: int = 5  # support images per class when evaluating


@dataclass
class ModelConfig:
    """The Reptile paper's conv net."""

    layers: int = 4
    filters: int = 64
    stride: int = 2
    pool: bool = False


@dataclass
class TrainConfig:
    """Meta-training: the outer loop of meta-iterations and the inner Adam steps of each task."""

    meta_iters: int = 1000  # meta-iterations (outer steps)
    meta_batch: int = 5  # tasks per meta-iteration
    inner_iters: int = 5  # Adam steps per task
    inner_batch: int = 10  # images per Adam step
    shots: int = 10  # images per class in a training task (the paper's train-shots)
    inner_lr: float = 0.001  # the inner optimiser's step size
    inner_optimizer: str = "adam"  # adam (beta1 = 0, the paper's) | sgd (plain steps)
    algorithm: str = "reptile"  # reptile | foml (first-order MAML: the last step's change)
    foml_tail: Optional[int] = None  # foml: the last step on this many images per class, kept apart
    replacement: bool = False  # inner batches drawn afresh each step (else shuffled passes)
    weight_decay: float = 1.0  # weights times this before each inner step (1: none), as the
    #                            reference does
    batch_tasks: bool = True  # the meta-batch's tasks adapt side by side in one program (Reptile)
    threads: int = 0  # threads sharing those tasks (0: the process's cores), 2+ tasks each
    meta_step: float = 1.0  # meta step size at the start ...
    meta_step_final: float = 0.0  # ... annealed linearly to this
    checkpoint_every: int = 100  # meta-iterations between checkpoints (0: only at the end)
    # minutes of wall-clock time between checkpoints, besides checkpoint_every (null: none;
    # off by default: checkpoints placed by time fall at steps that differ from run to run)
    checkpoint_minutes: Optional[float] = None
    keep_checkpoints: int = 2


@dataclass
class EvalConfig:
    """The evaluations: before and after meta-training, and the learning curve between."""

    tasks: int = 200  # test tasks of the final (and baseline) evaluation
    # training tasks of the final evaluation (train_accuracy): as eval.tasks, at most 20
    train_tasks: int = "${kspipe_min:${.tasks},20}"
    queries: int = 1  # query images per class
    inner_iters: int = 50  # Adam steps on a test task's support set
    inner_batch: int = 5
    baseline: bool = True  # also evaluate the model before meta-training
    transductive: bool = True  # queries share batch norm statistics; false: each query alone
    batch_tasks: int = 10  # test tasks adapted side by side in one program (1: one at a time)
    threads: int = 0  # threads adapting such groups at once (0: the process's cores)
    interval: int = 100  # meta-iterations between learning-curve points (0: none)
    # train and test tasks of each learning-curve point: as eval.tasks, at most 10
    interval_tasks: int = "${kspipe_min:${.tasks},10}"
