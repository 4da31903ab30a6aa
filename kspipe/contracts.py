"""What the hooks pass around, as types a plugin author can read and check against.

The concrete classes live with their concern (the one-process role in :mod:`kspipe.role`,
the modes' roles in :mod:`kspipe.modes`, the reporter in :mod:`kspipe.reporting`); these
Protocols say what a plugin may rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

#: The composed config (an ``omegaconf.DictConfig``).
Config = Any


@runtime_checkable
class Role(Protocol):
    """A process's place in a job and its mode's distribution: every method a workload, or
    a helper it calls, may use.  The base class, itself the one-process role, is
    :class:`kspipe.role.Role`; each mode's role subclasses it."""

    mode: str  #: the mode's name (``local``, ``pserver``, ``collective``)
    is_cluster_job: bool  #: false: this process plays a part (see :class:`ClusterJob`)

    # --- who am I
    def is_worker(self) -> bool: ...
    def is_server(self) -> bool: ...
    def is_first_worker(self) -> bool:
        """Whether this is worker 0, the one that saves, exports and records the run."""

    def worker_num(self) -> int: ...
    def worker_index(self) -> int: ...
    def place(self) -> Any:
        """The Paddle place this process computes on."""

    def split_files(self, files: list) -> list:
        """This worker's share of ``files``, in contiguous blocks."""

    # --- the workers' collectives
    def all_gather(self, value: float) -> list:
        """Every worker's ``value``, in worker order."""

    def all_reduce_worker(self, input: np.ndarray, output: np.ndarray, mode: str = "sum") -> None:
        """``output`` becomes the workers' ``input`` combined by ``mode`` (sum, min, max)."""

    def barrier_worker(self) -> None: ...

    # --- distribution
    def refuses(self, needs: frozenset, cfg: Config) -> str | None:
        """Why this mode cannot give the workload its ``needs`` (:data:`NEEDS`); None if
        it can (the pipeline asks before any process starts)."""

    def distributed_optimizer(
        self, optimizer: Any, strategy: dict | None = None, feeding: str = "executor"
    ) -> Any:
        """``optimizer``, whose ``minimize(loss)`` writes the mode's exchange into the
        program; ``feeding``: ``"executor"`` or ``"dataset"`` (``train_from_dataset``)."""

    def parameter_sync(self, shapes: dict) -> ParameterSync:
        """An exchange of the parameters ``shapes`` (``{name: shape}``) names, for a
        workload that makes its own updates."""

    def embedding(self, ids: Any, size: list, param_attr: Any, feeding: str = "executor") -> Any:
        """An embedding table of ``size`` = [rows, width] where the mode keeps it, looked
        up with the int64 ``ids``."""

    def init_worker(self, scope: Any = None) -> None:
        """After the startup program: ``scope`` then holds the job's starting parameters."""

    def finish_training(self, scope: Any = None) -> None:
        """After the training loop: ``scope`` then holds the model every worker trained."""

    def stop_worker(self, clean: bool = True) -> None:
        """Leave the job (the pipeline calls it)."""

    def run_server(self, reporter: Reporter) -> None:
        """A server's whole part in the job (the pipeline calls it)."""

    # --- tables kept outside the workers' scopes (the parameter servers')
    def settle_tables(self) -> None:
        """Every worker: return once every worker's updates are in the job's tables."""

    def save_tables(self, folder: str) -> None:
        """The first worker, after :meth:`settle_tables`: write the tables into ``folder``
        (``checkpoint.save(..., tables=role.save_tables)``)."""

    def load_tables(self, folder: str, scope: Any = None) -> None:
        """Every worker, after :meth:`init_worker`: the tables :meth:`save_tables` wrote
        into ``folder`` become the job's (checked first)."""

    def load_table_rows(self, rows: dict, folder: str) -> None:
        """Every worker, after :meth:`init_worker`: the tables get ``rows`` (``{name: (ids,
        embedding rows)}``) with fresh optimiser state; ``folder`` takes the files this
        needs (``init_from=``, :mod:`kspipe.checkpoint.incremental`)."""

    def end_day_tables(self, folder: str) -> None:
        """The first worker, after :meth:`settle_tables`, at a day's end: the tables age a
        day (every row's unseen days up by one; ``folder`` takes the files this writes, and
        is removed) and shrink (decay show and click, delete the rows their accessor's
        thresholds say)."""


@runtime_checkable
class ParameterSync(Protocol):
    """What :meth:`Role.parameter_sync` returns: ``step(scope)`` after each local update
    combines the workers' parameters as the mode does."""

    changes_parameters: bool  #: whether ``step`` may change the parameters in the scope

    def step(self, scope: Any = None) -> None: ...


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

    def launch(self, reporter: Reporter) -> dict: ...
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
    def plan(
        self, kind: str, cfg: Config, workers: Any, servers: Any = None, **options: Any
    ) -> list: ...
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
        :func:`kspipe.checkpoint.incremental.start_from`); if not, a run given one is refused.
    :param resumes: whether it honours ``resume=`` (its execute stage goes on from the
        checkpoint ``cfg.resume`` names, through :func:`kspipe.checkpoint.latest` and
        :func:`kspipe.checkpoint.load`); if not, a run given one is refused, and so is a job
        with ``cluster.max_restarts`` above 0, which a restart would start over from nothing.
    :param groups: the config groups a run of it reads, which its MLflow run logs as params;
        empty: the command fills them in, every group but those of the stage plugins the
        run does not use (another workload's, another data set's).
    :param steps: how many steps its training shares among the workers (Reptile: its
        meta-iterations), and ``steps_key`` the setting that says so; a job of more
        workers, one of which would get none, is refused before anything starts
        (:func:`kspipe.config.size.check_work`).  0: not said.
    """

    name: str
    headline: str
    rate: str
    summary: tuple = ()
    needs: frozenset = field(default_factory=frozenset)
    serving: str = ""
    starts_from: bool = False
    resumes: bool = False
    groups: tuple = ()
    steps: int = 0
    steps_key: str = ""

    def shown(self) -> tuple:
        return self.summary or (self.headline, self.rate)


@dataclass(frozen=True)
class TrainingData:
    """What a data set says of itself in the run's record: the run's input in MLflow (the
    runs table's dataset column).  The object ``kspipe_read_dataset`` returns carries it as
    its attribute ``training_data``; a data set without one is not recorded.

    :param name: shown in the runs table (``omniglot``, ``kanjivg-embedded``).
    :param source: where it comes from: a folder, a file, a URL, a package and its version.
    :param files: the files read (train, validation and test, every worker's); the digest
        is their contents' (:func:`kspipe.files.files_digest`, worked out by the recorder
        process, not the job's), so two runs on the same files show the same digest
        wherever the files are.
    :param digest: the digest itself, for data read from no files (a generated set: hash
        its arrays, or its seed and sizes); given, ``files`` are not read for it.
    :param profile: a few counts shown with it (``{"classes": 964, "images": 19280}``).
    """

    name: str
    source: str
    files: tuple = ()
    digest: str = ""
    profile: dict = field(default_factory=dict)
