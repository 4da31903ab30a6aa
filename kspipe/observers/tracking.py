"""MLflow tracking: the one place kspipe touches MLflow.

A run (the :class:`MlflowTracker` plugin): only the first worker records.  A run gets the
flattened resolved config as params, its workload's name and metrics as tags
(``kspipe.workload``, ``kspipe.headline``, ``kspipe.rate``, ``kspipe.summary``), every
metric the stages report, the resolved config, the inference model and a learning-curve
PNG of the ``curve/*`` series as artifacts, the inference model as the MLflow model
``model`` (:mod:`kspipe.observers.serving`; registered as ``tracking.register`` if set),
and ends FINISHED, FAILED or KILLED.  Its last line names the command that opens the
runs page of the experiment (:func:`runs_page`).

A sweep (called by :mod:`kspipe.observers.sweep`): :func:`start_parent_run` makes the
parent and names it in ``KSPIPE_PARENT_RUN_ID``, whose runs become its children;
:func:`child_runs` reads them back as plain :class:`RunRecord` values and
:func:`finish_parent_run` attaches the comparison and ends the parent.

The store is ``cfg.tracking.uri``, by default a SQLite file ``mlflow.db`` in the working
folder.  Every client comes from :func:`client_for`, which opens the store once under a
lock (:func:`store_lock`): MLflow creates or migrates a SQLite store on its first call, and
jobs started together would otherwise race to do it.  A store that cannot be opened is a
one-line :class:`~kspipe.errors.ConfigError` before anything runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from dataclasses import dataclass

from kspipe import hookimpl
from kspipe.contracts import Workload
from kspipe.errors import ConfigError, KspipeError
from kspipe.files import user_path
from kspipe.reporting import say

PARENT_RUN_ENV = "KSPIPE_PARENT_RUN_ID"
RUN_ENV = "KSPIPE_RUN_ID"  # a cluster's launcher made the run; its first worker records into it
MAX_PARAM_LENGTH = 6000


def tracking_uri(cfg) -> str:
    uri = cfg.tracking.uri or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not os.path.isabs(uri[len("sqlite:///"):]):
        uri = "sqlite:///" + user_path(uri[len("sqlite:///"):])  # from where kspipe started
    return uri


def client_for(cfg):
    """An ``MlflowClient`` on ``cfg``'s store, with MLflow's own logging quietened.

    The client is made, and the experiment ``cfg.tracking.experiment`` found or created,
    while holding :func:`store_lock`: the first of several jobs started at once creates (or
    migrates) the store and the experiment, the others wait for it and then find them.
    A store that cannot be opened raises :class:`ConfigError` naming ``tracking.uri``.
    """
    import logging

    from mlflow import MlflowClient

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    uri = tracking_uri(cfg)
    with store_lock(uri):
        try:
            probe_sqlite(uri)
            client = MlflowClient(tracking_uri=uri)
            experiment_id(client, cfg.tracking.experiment)
        except KspipeError:
            raise
        except Exception as err:  # MLflow's, SQLAlchemy's, the file system's: all say why
            raise store_error(uri, err) from err
    return client


def experiment_id(client, name: str) -> str:
    """The id of the experiment ``name``, created if there is none."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # made meanwhile by a process that does not take the lock
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def sqlite_path(uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI; None for another store or an in-memory one."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].partition("?")[0]
    return path if path and path != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str):
    """Hold an exclusive lock on a SQLite store while it is opened; nothing for other stores.

    The lock is ``flock`` on the store's folder itself (made if missing), so it leaves no
    file behind; it goes with the descriptor, when the block ends or the process dies.
    """
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    try:
        fd = lock_folder(path)
    except OSError as err:
        raise store_error(uri, err) from err
    try:
        yield
    finally:
        os.close(fd)


def lock_folder(path: str) -> int:
    """An open descriptor holding ``flock`` on ``path``'s folder.  Where the file system
    does not lock folders, the file ``path`` is locked instead (created empty if missing,
    which SQLite reads as a new database)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    try:
        return flocked(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        if err.errno not in FOLDER_LOCK_REFUSED:
            raise
    return flocked(path, os.O_RDWR | os.O_CREAT)


def flocked(path: str, flags: int) -> int:
    """``path`` opened with ``flags`` and locked exclusively (waiting for the lock)."""
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: What ``flock`` on a folder answers on a file system that only locks files.
FOLDER_LOCK_REFUSED = (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP)


def probe_sqlite(uri: str) -> None:
    """Read a SQLite store's header, so a file that is no database (or cannot be read) fails
    at once; MLflow would retry it for about two minutes."""
    path = sqlite_path(uri)
    if path is None:
        return
    import sqlite3

    connection = sqlite3.connect(path)
    try:
        connection.execute("pragma schema_version").fetchone()
    finally:
        connection.close()


def store_error(uri: str, err: Exception) -> ConfigError:
    """The one line for a store that cannot be opened, with the reason's first line."""
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()),
                  type(err).__name__)
    return ConfigError(f"tracking.uri={uri}: cannot open the MLflow store: {reason}")


def flatten(tree, prefix: str = "") -> dict:
    """Nested dicts and lists as ``{"a.b": value}``."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


# --- the workload, as tags ----------------------------------------------------------


def workload_tags(workload: Workload) -> dict:
    """The tags that say which workload a run ran and which of its metrics tell of it."""
    tags = {"kspipe.workload": workload.name, "kspipe.headline": workload.headline,
            "kspipe.rate": workload.rate,
            "kspipe.summary": ",".join(name for name in workload.shown() if name)}
    return {key: value for key, value in tags.items() if value}


def workload_from_tags(tags: dict) -> Workload | None:
    """The workload :func:`workload_tags` recorded; None for a run without them."""
    if not tags.get("kspipe.workload"):
        return None
    summary = tuple(name for name in tags.get("kspipe.summary", "").split(",") if name)
    return Workload(name=tags["kspipe.workload"], headline=tags.get("kspipe.headline", ""),
                    rate=tags.get("kspipe.rate", ""), summary=summary)


def source_run_id(client, path: str) -> str | None:
    """The run that wrote the run folder of ``path`` (a run folder or one of its
    checkpoints), found by its ``kspipe.run_dir`` tag; None where this store has none."""
    from kspipe.files import user_path

    folder = os.path.abspath(user_path(path))
    while os.path.basename(folder).startswith(("checkpoint-", "worker-", "checkpoints")):
        folder = os.path.dirname(folder)
    if "'" in folder:
        return None  # not expressible in a filter string
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, f"tags.`kspipe.run_dir` = '{folder}'",
                               max_results=1) if experiments else []
    return found[0].info.run_id if found else None


# --- a run ------------------------------------------------------------------------


class MlflowTracker:
    """The tracking plugin; one instance per plugin manager.  The run's workload comes
    with ``kspipe_run_start``, as the pipeline described it once for the run."""

    def __init__(self):
        self.client = None
        self.run_id = None
        self.owner = False
        self.workload: Workload | None = None
        self.curve: dict[str, list] = {}

    @hookimpl
    def kspipe_run_start(self, cfg, role, run_dir, workload):
        self.workload = workload
        if not cfg.tracking.enabled or not role.is_first_worker():
            return
        from mlflow.entities import Param
        from omegaconf import OmegaConf

        self.client = client_for(cfg)
        self.curve = {}
        self.owner = not (os.environ.get(RUN_ENV) and not role.is_launcher)
        if not self.owner:
            self.run_id = os.environ[RUN_ENV]
            return
        if cfg.tracking.get("register"):
            from kspipe.observers import serving

            if not cfg.tracking.get("model", True):
                raise ConfigError(f"tracking.register={cfg.tracking.register} registers the "
                                  f"run's MLflow model, which tracking.model=false does not log")
            serving.check_registry_name(self.client, cfg.tracking.register)
        tags = {"kspipe.mode": cfg.mode, "kspipe.run_dir": run_dir,
                **workload_tags(workload)}
        if os.environ.get(PARENT_RUN_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
        if cfg.get("evaluate") or cfg.get("init_from"):
            source = source_run_id(self.client, cfg.get("evaluate") or cfg.init_from)
            if source:
                tags["kspipe.source_run"] = source
        run = self.client.create_run(experiment_id(self.client, cfg.tracking.experiment),
                                     run_name=cfg.tracking.run_name, tags=tags)
        self.run_id = run.info.run_id
        if role.is_launcher:
            os.environ[RUN_ENV] = self.run_id  # inherited by the processes it starts
        resolved = OmegaConf.to_container(cfg, resolve=True)
        params = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in flatten(resolved).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        config_path = os.path.join(run_dir, "config.yaml")
        OmegaConf.save(cfg, config_path, resolve=True)
        self.client.log_artifact(self.run_id, config_path)

    @hookimpl
    def kspipe_log_metrics(self, metrics, step):
        if self.run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)
        for k, v in metrics.items():
            self.curve.setdefault(k, []).append((step, float(v)))

    @hookimpl
    def kspipe_log_artifact(self, path, artifact_path):
        if self.run_id is None:
            return
        if os.path.isdir(path):
            self.client.log_artifacts(self.run_id, path, artifact_path or None)
        else:
            self.client.log_artifact(self.run_id, path, artifact_path or None)

    @hookimpl
    def kspipe_run_end(self, cfg, metrics, run_dir):
        if self.run_id is None:
            return
        if any(name.startswith("curve/") for name in self.curve):
            plot = learning_curve(self.curve, os.path.join(run_dir, "learning_curve.png"),
                                  self.workload.headline)
            if plot:
                self.client.log_artifact(self.run_id, plot)
        if not self.owner:
            self.run_id = None
            return
        try:
            self.log_model(cfg, run_dir)
        except BaseException:
            self._end("FAILED")
            raise
        run_id = self.run_id
        self._end("FINISHED")
        if not os.environ.get(PARENT_RUN_ENV):  # a sweep names the page once, at its end
            experiment = self.client.get_run(run_id).info.experiment_id
            say(runs_page(cfg, experiment, self.workload.headline))

    def log_model(self, cfg, run_dir: str) -> None:
        """The run's inference model as its MLflow model, if its workload names a predictor.

        A registry that refuses ``tracking.register`` fails the run (a
        :class:`KspipeError`); a model that cannot be logged otherwise is said in one line
        and the trained run is kept.
        """
        serving = self.workload.serving
        if (not serving or not cfg.tracking.get("model", True)
                or not os.path.isdir(os.path.join(run_dir, "inference_model"))):
            return
        from kspipe.observers.serving import log_model

        try:
            log_model(tracking_uri(cfg), self.run_id, run_dir, serving,
                      cfg.tracking.get("register"))
        except KspipeError:
            raise
        except Exception as err:
            reason = next((line for line in str(err).splitlines() if line.strip()),
                          type(err).__name__)
            say(f"the run's MLflow model was not logged ({serving}): {reason}")

    @hookimpl
    def kspipe_run_error(self, cfg, error):
        if self.run_id is None:
            return
        self._end("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")

    def _end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
        if os.environ.get(RUN_ENV) == self.run_id:
            del os.environ[RUN_ENV]
        self.run_id = None


def runs_page(cfg, experiment: str, headline: str = "") -> str:
    """The command that serves the store, and the page of the experiment's runs table
    (``mlflow ui`` opens an experiment on its overview, not on its runs), best
    ``headline`` first: sorted by a metric, the table also lists a sweep's child runs
    instead of folding them under their parent."""
    order = f"?orderByKey=metrics.%60{headline}%60&orderByAsc=false" if headline else ""
    return (f"runs: mlflow ui --backend-store-uri {tracking_uri(cfg)} then "
            f"http://127.0.0.1:5000/#/experiments/{experiment}/runs{order}")


def learning_curve(curve: dict, path: str, headline: str = "") -> str | None:
    """Plot the ``curve/*`` series (and ``baseline_<headline>`` as a line, when reported) to
    ``path``; None if there is nothing to plot."""
    series = {k: v for k, v in curve.items() if k.startswith("curve/")}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    values = []
    for name, points in sorted(series.items()):
        steps, ys = zip(*points)
        values.extend(ys)
        ax.plot(steps, ys, marker="o", label=name.split("/", 1)[1])
    baseline = f"baseline_{headline}"
    if headline and baseline in curve:
        level = curve[baseline][-1][1]
        values.append(level)
        ax.axhline(level, color="grey", linestyle="--", label=baseline.replace("_", " "))
    ax.set_xlabel("step")
    if all(0 <= v <= 1 for v in values):  # accuracies, AUCs: the whole scale
        ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- a sweep: one parent run, a child run per job -------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """A sweep job's run as the comparison reads it (no MLflow type leaves this module).

    :param workload: what the run's tags say it ran; None for a run without them.
    """

    run_id: str
    name: str | None
    status: str
    params: dict
    metrics: dict
    workload: Workload | None


def start_parent_run(cfg, run_name: str, tags: dict) -> str:
    """Create a sweep's parent run and name it in ``KSPIPE_PARENT_RUN_ID``, so the runs of
    the jobs (in this process or the ones it starts) become its children; return its id."""
    client = client_for(cfg)
    run = client.create_run(experiment_id(client, cfg.tracking.experiment),
                            run_name=run_name, tags=tags)
    os.environ[PARENT_RUN_ENV] = run.info.run_id
    return run.info.run_id


def child_runs(cfg, parent_id: str) -> list[RunRecord]:
    """The runs of the sweep ``parent_id``, first started first."""
    client = client_for(cfg)
    found = client.search_runs([client.get_run(parent_id).info.experiment_id],
                               filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                               order_by=["attributes.start_time ASC"])
    return [RunRecord(run_id=run.info.run_id, name=run.info.run_name, status=run.info.status,
                      params=dict(run.data.params), metrics=dict(run.data.metrics),
                      workload=workload_from_tags(run.data.tags)) for run in found]


def finish_parent_run(cfg, parent_id: str, status: str, artifacts=(), tags=None) -> None:
    """Attach ``artifacts`` (files) and ``tags`` to the parent run and end it with ``status``
    (``FINISHED`` or ``FAILED``); ``KSPIPE_PARENT_RUN_ID`` is cleared whatever happens."""
    try:
        client = client_for(cfg)
        for path in artifacts:
            client.log_artifact(parent_id, path)
        for key, value in (tags or {}).items():
            client.set_tag(parent_id, key, value)
        client.set_terminated(parent_id, status)
        parent = client.get_run(parent_id)
        say(runs_page(cfg, parent.info.experiment_id, parent.data.tags.get("kspipe.headline", "")))
    finally:
        if os.environ.get(PARENT_RUN_ENV) == parent_id:
            del os.environ[PARENT_RUN_ENV]
