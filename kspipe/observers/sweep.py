"""Hydra sweeps (``kspipe -m ...``): one parent MLflow run, a child run per job, and a
comparison of the jobs on the parent.

The callback creates the parent run when the sweep starts and tells every job through
``KSPIPE_PARENT_RUN_ID``.  A job that fails is reported on one line and recorded (its child
run FAILED); the others still run.  At the end the parent gets ``comparison.csv`` and
``comparison.png`` (test accuracy or AUC, and tasks/s or samples/s, per job) and ends FAILED if any job failed,
and the command exits non-zero.
"""

from __future__ import annotations

import csv
import os

from hydra.experimental.callback import Callback

from kspipe.observers.tracking import PARENT_RUN_ENV, tracking_uri

#: Jobs of the current sweep that failed (the command's exit status depends on it).
FAILED_JOBS: list[str] = []
#: The keys the current sweep varies; a job is named by its values of them.
SWEPT_KEYS: list[str] = []


def swept_keys(overrides) -> list[str]:
    """Keys of command-line overrides that list several values (``workers=1,2,4``)."""
    keys = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and ("," in value or value.startswith(("range(", "choice(", "glob("))) \
                and not value.startswith(("[", "{", "'", '"')):
            keys.append(key.lstrip("+~"))
    return keys


def job_label(overrides) -> str | None:
    """A sweep job's name from its overrides: ``mode=pserver,workers=2``."""
    chosen = [o.lstrip("+~") for o in overrides if o.partition("=")[0].lstrip("+~") in SWEPT_KEYS]
    return ",".join(chosen) or None


class SweepCallback(Callback):
    def __init__(self):
        self.client = None
        self.parent_id = None

    def on_multirun_start(self, config, **kwargs) -> None:
        FAILED_JOBS.clear()
        SWEPT_KEYS[:] = swept_keys(config.hydra.overrides.task)
        if not config.tracking.enabled:
            return
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri(config))
        experiment = self.client.get_experiment_by_name(config.tracking.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(config.tracking.experiment))
        sweep = ", ".join(f"{k}={v}" for k, v in (config.hydra.sweeper.params or {}).items())
        overrides = " ".join(config.hydra.overrides.task)
        run = self.client.create_run(experiment_id, run_name=f"sweep {overrides}",
                                     tags={"kspipe.sweep": "parent", "kspipe.overrides": overrides,
                                           "kspipe.sweep_params": sweep})
        self.parent_id = run.info.run_id
        os.environ[PARENT_RUN_ENV] = self.parent_id

    def on_multirun_end(self, config, **kwargs) -> None:
        if self.parent_id is None:
            return
        try:
            children = self.client.search_runs(
                [self.client.get_run(self.parent_id).info.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'",
                order_by=["attributes.start_time ASC"])
            folder = os.path.join(config.hydra.sweep.dir, "comparison")
            os.makedirs(folder, exist_ok=True)
            rows = [comparison_row(child, SWEPT_KEYS) for child in children]
            table = write_table(rows, os.path.join(folder, "comparison.csv"))
            self.client.log_artifact(self.parent_id, table)
            plot = plot_comparison(rows, os.path.join(folder, "comparison.png"))
            if plot:
                self.client.log_artifact(self.parent_id, plot)
            failed = FAILED_JOBS or [r["job"] for r in rows if r["status"] != "FINISHED"]
            self.client.set_terminated(self.parent_id, "FAILED" if failed else "FINISHED")
        finally:
            os.environ.pop(PARENT_RUN_ENV, None)
            self.parent_id = None


#: Compared per job: each workload's score and rate (Reptile: accuracy and tasks/s;
#: the ctr workload: AUC and samples/s).
COLUMNS = ["test_accuracy", "test_accuracy_ci95", "baseline_test_accuracy", "tasks_per_s",
           "test_auc", "samples_per_s"]
SCORES = {"test_accuracy": "test accuracy", "test_auc": "test AUC"}
RATES = {"tasks_per_s": "tasks/s", "samples_per_s": "samples/s"}


def comparison_row(run, swept: list[str]) -> dict:
    """One job of the sweep, named by the values of the swept keys."""
    name = ", ".join(f"{k}={run.data.params.get(k, '?')}" for k in swept)
    row = {"job": name or run.info.run_name or run.info.run_id, "run_id": run.info.run_id,
           "status": run.info.status}
    row.update({key: run.data.metrics.get(key) for key in COLUMNS})
    return row


def write_table(rows: list[dict], path: str) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["job", "run_id", "status", *COLUMNS])
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot_comparison(rows: list[dict], path: str) -> str | None:
    score = next((k for k in SCORES if any(r[k] is not None for r in rows)), None)
    if score is None:
        return None
    rate = next((k for k in RATES if any(r[k] is not None for r in rows)), "tasks_per_s")
    done = [r for r in rows if r[score] is not None]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["job"] for r in done]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.6 * len(done) + 2))
    left.barh(labels, [r[score] for r in done], color="tab:blue",
              xerr=[r.get(score + "_ci95") or 0 for r in done])
    left.set_xlabel(SCORES[score])
    left.set_xlim(0, 1)
    right.barh(labels, [r[rate] or 0 for r in done], color="tab:orange")
    right.set_xlabel(RATES[rate])
    right.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
