"""What the hooks pass around, as types a plugin author can read and check against.

The concrete classes live with their concern (roles in :mod:`kspipe.modes.role`, the
reporter in :mod:`kspipe.reporting`); these Protocols say what a plugin may rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

#: The composed config (an ``omegaconf.DictConfig``).
Config = Any


@runtime_checkable
class Role(Protocol):
    """A process's place in a job and its mode's distribution (see :mod:`kspipe.modes.role`)."""

    mode: str
    is_cluster_job: bool

    def is_worker(self) -> bool: ...
    def is_server(self) -> bool: ...
    def is_first_worker(self) -> bool: ...
    def worker_num(self) -> int: ...
    def worker_index(self) -> int: ...
    def place(self) -> Any: ...
    def split_files(self, files: list) -> list: ...
    def all_gather(self, value: float) -> list: ...
    def all_reduce_worker(self, input: np.ndarray, output: np.ndarray, mode: str = "sum") -> None: ...
    def barrier_worker(self) -> None: ...
    def refuses(self, needs: frozenset, cfg: Config) -> str | None: ...
    def distributed_optimizer(self, optimizer: Any, strategy: dict | None = None,
                              feeding: str = "executor") -> Any: ...
    def parameter_sync(self, shapes: dict) -> Any: ...
    def embedding(self, ids: Any, size: list, param_attr: Any,
                  feeding: str = "executor") -> Any: ...
    def init_worker(self, scope: Any = None) -> None: ...
    def finish_training(self, scope: Any = None) -> None: ...
    def stop_worker(self, clean: bool = True) -> None: ...
    def run_server(self, reporter: "Reporter") -> None: ...


@runtime_checkable
class ClusterJob(Protocol):
    """A role stage's result that starts the job's processes instead of playing a part.

    ``is_cluster_job`` is true; the pipeline calls ``launch`` and records its result.  It
    plans the job's processes and has the process launcher (``cluster.launcher``) start
    each with ``python -m kspipe.cli.worker <run_dir>/job.yaml`` and the environment its
    roles read; every process is stopped when one fails, and a
    :class:`kspipe.errors.ClusterError` names it (:mod:`kspipe.modes.job`).
    """

    is_cluster_job: bool

    def launch(self, reporter: "Reporter") -> dict: ...
    def refuses(self, needs: frozenset, cfg: Config) -> str | None: ...

    def is_first_worker(self) -> bool:
        """Whether this host runs worker 0 (its command records the run; in a job across
        hosts the others' ``launch`` returns ``{}``)."""


class ProcessLauncher(Protocol):
    """``cluster.launcher``: places the processes a mode planned and says how each is
    started (kspipe starts, watches and stops them); base class and the decisions in order:
    :class:`kspipe.launchers.processes.ProcessLauncher`."""

    name: str

    def hands_off(self, cfg: Config) -> bool: ...
    def hand_off(self, cfg: Config, overrides: list) -> str: ...
    def check(self, cfg: Config, processes: int) -> None: ...
    def plan(self, kind: str, cfg: Config, workers: Any, servers: Any = None,
             **options: Any) -> list: ...
    def command(self, planned: Any, command: list) -> list: ...


@runtime_checkable
class Reporter(Protocol):
    """Where a stage reports; the lifecycle hooks take it to every observer."""

    run_dir: str

    def progress(self, task: str, step: int, total: int, values: dict | None = None) -> None: ...
    def metrics(self, metrics: dict, step: int) -> None: ...
    def artifact(self, path: str, artifact_path: str = "") -> None: ...
    def say(self, message: str) -> None: ...


@runtime_checkable
class FewShotClass(Protocol):
    """One class of a few-shot data set: its images, drawn ``num_images`` at a time."""

    def __len__(self) -> int: ...
    def sample(self, num_images: int, rng: np.random.Generator | None = None) -> np.ndarray: ...


#: What a workload may need of its mode (:attr:`Workload.needs`); a mode's ``refuses`` says
#: which it cannot give.
NEEDS = {
    "dataset_training": "trains with Executor.train_from_dataset (C++ reader threads)",
    "sparse_tables": "keeps embedding tables with sparse updates",
}


@dataclass(frozen=True)
class Workload:
    """What a workload (the plugin serving ``program``) declares of itself.

    :param name: shown in messages (``reptile``, ``ctr``).
    :param headline: the metric that says how good a run is (``test_accuracy``).
    :param rate: the metric that says how fast it trained (``tasks_per_s``).
    :param summary: the metrics the closing line shows, in order (default: headline, rate).
    :param needs: what it needs of a mode (keys of :data:`NEEDS`); a mode that
        cannot give one refuses the job before any process starts.
    :param serving: ``module:Class`` of the predictor that serves its exported model as an
        MLflow model (:mod:`kspipe.observers.mlflow.serving` says what it must offer); empty: the
        run logs its ``inference_model/`` folder but no MLflow model.
    :param starts_from: whether it honours ``init_from=`` (its execute stage calls
        :func:`kspipe.incremental.start_from`); if not, a run given one is refused.
    """

    name: str
    headline: str
    rate: str
    summary: tuple = ()
    needs: frozenset = field(default_factory=frozenset)
    serving: str = ""
    starts_from: bool = False

    def shown(self) -> tuple:
        return self.summary or (self.headline, self.rate)
