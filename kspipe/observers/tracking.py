"""The ``mlflow`` plugin: a run's record in MLflow, kept by the first worker only.

A run (:class:`MlflowTracker`) gets the flattened resolved config as params, its workload's
name and metrics as tags (:mod:`kspipe.observers.tags`), every metric the stages report,
the resolved config, the inference model and a learning-curve PNG of the ``curve/*``
series (:mod:`kspipe.observers.plots`) as artifacts, the inference model as the MLflow
model ``model`` (:mod:`kspipe.observers.serving`; registered as ``tracking.register`` if
set), and ends FINISHED, FAILED or KILLED.  Its last line names the command that opens the
runs page of the experiment (:func:`kspipe.observers.store.runs_page`).

Its client comes from :func:`kspipe.observers.store.client_for`; in a sweep, the run
becomes a child of the parent that ``KSPIPE_PARENT_RUN_ID`` names
(:mod:`kspipe.observers.sweep_runs`).
"""

from __future__ import annotations

import os
import time

from kspipe import hookimpl
from kspipe.contracts import Workload
from kspipe.errors import ConfigError, KspipeError, first_line
from kspipe.observers.plots import learning_curve
from kspipe.observers.store import client_for, experiment_id, runs_page, tracking_uri
from kspipe.observers.sweep_runs import PARENT_RUN_ENV
from kspipe.observers.tags import workload_tags
from kspipe.reporting import say

RUN_ENV = "KSPIPE_RUN_ID"  # a cluster's launcher made the run; its first worker records into it
MAX_PARAM_LENGTH = 6000


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
            say(f"the run's MLflow model was not logged ({serving}): {first_line(err)}")

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
