"""MLflow tracking: the one place kspipe touches MLflow.

Only the first worker records.  A run gets the flattened resolved config as params,
every metric the stages report, the resolved config, the inference model and a
learning-curve PNG as artifacts, and ends FINISHED, FAILED or KILLED.  The store is
``cfg.tracking.uri``, by default a SQLite file ``mlflow.db`` in the working folder.
A sweep's jobs become children of the run named by ``KSPIPE_PARENT_RUN_ID``.
"""

from __future__ import annotations

import os
import time

from kspipe import hookimpl
from kspipe.files import user_path

PARENT_RUN_ENV = "KSPIPE_PARENT_RUN_ID"
RUN_ENV = "KSPIPE_RUN_ID"  # a cluster's launcher made the run; its first worker records into it
MAX_PARAM_LENGTH = 6000


def tracking_uri(cfg) -> str:
    uri = cfg.tracking.uri or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not os.path.isabs(uri[len("sqlite:///"):]):
        uri = "sqlite:///" + user_path(uri[len("sqlite:///"):])  # from where kspipe started
    return uri


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


class MlflowTracker:
    """The tracking plugin; one instance per plugin manager."""

    def __init__(self):
        self.client = None
        self.run_id = None
        self.curve: dict[str, list] = {}

    @hookimpl
    def kspipe_run_start(self, cfg, role, run_dir):
        if not cfg.tracking.enabled or not role.is_first_worker():
            return
        import logging

        from mlflow import MlflowClient
        from mlflow.entities import Param
        from omegaconf import OmegaConf

        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=tracking_uri(cfg))
        self.curve = {}
        self.owner = not (os.environ.get(RUN_ENV) and not role.is_launcher)
        if not self.owner:
            self.run_id = os.environ[RUN_ENV]
            return
        experiment = self.client.get_experiment_by_name(cfg.tracking.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(cfg.tracking.experiment))
        tags = {"kspipe.mode": cfg.mode, "kspipe.run_dir": run_dir}
        if os.environ.get(PARENT_RUN_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
        run = self.client.create_run(experiment_id, run_name=cfg.tracking.run_name, tags=tags)
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
        plot = learning_curve(self.curve, os.path.join(run_dir, "learning_curve.png"))
        if plot:
            self.client.log_artifact(self.run_id, plot)
        if self.owner:
            self._end("FINISHED")
        else:
            self.run_id = None

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


def learning_curve(curve: dict, path: str) -> str | None:
    """Plot the accuracy curves (and the baseline) to ``path``; None if there is nothing."""
    series = {k: v for k, v in curve.items() if k.startswith("curve/")}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sorted(series.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o", label=name.split("/", 1)[1])
    if "baseline_test_accuracy" in curve:
        ax.axhline(curve["baseline_test_accuracy"][-1][1], color="grey", linestyle="--",
                   label="baseline test accuracy")
    ax.set_xlabel("meta-iteration")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
