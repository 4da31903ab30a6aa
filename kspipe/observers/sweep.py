"""Hydra sweeps (``kspipe -m ...``): one parent run, a child run per job, and a comparison
of the jobs on the parent.

A hyperparameter search (``hydra/sweeper=optuna``) is such a sweep: each trial is a job
whose value is its workload's headline metric, and the parent names the best trial.

The callback has :mod:`kspipe.observers.tracking` create the parent run when the sweep
starts; every job's run becomes its child.  A job that fails is reported on one line and
recorded (its child run FAILED); the others still run.  At the end the parent gets
``comparison.csv`` and ``comparison.png``: per job, the metrics its workload declares
(:class:`kspipe.contracts.Workload`: the headline, with ``<headline>_ci95`` as error bar
where reported, the rate and the summary metrics; the union of them when the jobs ran
different workloads).  The parent ends FAILED if any job failed, and the command exits
non-zero.
"""

from __future__ import annotations

import csv
import os

from hydra.experimental.callback import Callback

from kspipe.contracts import Workload
from kspipe.observers import tracking

#: Jobs of the current sweep that failed (the command's exit status depends on it).
FAILED_JOBS: list[str] = []
#: The keys the current sweep varies; a job is named by its values of them.
SWEPT_KEYS: list[str] = []


def swept_keys(overrides) -> list[str]:
    """Keys of command-line overrides that list several values (``workers=1,2,4``)."""
    keys = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and ("," in value or value.startswith(("range(", "choice(", "glob(", "interval(",
                                                       "tag("))) \
                and not value.startswith(("[", "{", "'", '"')):
            keys.append(key.lstrip("+~"))
    return keys


def job_label(overrides) -> str | None:
    """A sweep job's name from its overrides: ``mode=pserver,workers=2``."""
    chosen = [o.lstrip("+~") for o in overrides if o.partition("=")[0].lstrip("+~") in SWEPT_KEYS]
    return ",".join(chosen) or None


def sweep_workload(config) -> Workload:
    """The workload the sweep's config runs (a job that sweeps ``stages.program`` tells its
    own through its run's tags)."""
    from kspipe.plugin_manager import describe_workload, get_plugin_manager

    return describe_workload(get_plugin_manager(), config)


class SweepCallback(Callback):
    def __init__(self):
        self.parent_id = None
        self.workload: Workload | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        FAILED_JOBS.clear()
        SWEPT_KEYS[:] = swept_keys(config.hydra.overrides.task)
        if not config.tracking.enabled:
            return
        self.workload = sweep_workload(config)
        sweep = ", ".join(f"{k}={v}" for k, v in (config.hydra.sweeper.params or {}).items())
        overrides = " ".join(config.hydra.overrides.task)
        self.parent_id = tracking.start_parent_run(
            config, f"sweep {overrides}",
            {"kspipe.sweep": "parent", "kspipe.overrides": overrides,
             "kspipe.sweep_params": sweep, **tracking.workload_tags(self.workload)})

    def on_multirun_end(self, config, **kwargs) -> None:
        if self.parent_id is None:
            return
        status, outputs, tags = "FAILED", [], {}
        try:
            jobs = tracking.child_runs(config, self.parent_id)
            workloads = [job.workload or self.workload for job in jobs]
            folder = os.path.join(config.hydra.sweep.dir, "comparison")
            os.makedirs(folder, exist_ok=True)
            columns = comparison_columns(jobs, workloads)
            rows = [comparison_row(job, SWEPT_KEYS, w, columns) for job, w in zip(jobs, workloads)]
            outputs = [write_table(rows, columns, os.path.join(folder, "comparison.csv")),
                       plot_comparison(rows, workloads, os.path.join(folder, "comparison.png"))]
            names = unique(w.name for w in workloads) or [self.workload.name]
            tags = {"kspipe.workload": ",".join(names), **best_job(rows, workloads)}
            counted = {failure.partition(":")[0] for failure in FAILED_JOBS}
            FAILED_JOBS.extend(  # jobs another launcher ran (submitit's Slurm jobs)
                f"{r['job']}: its run ended {r['status']}" for r in rows
                if r["status"] != "FINISHED" and str(r["job"]) not in counted)
            status = "FAILED" if FAILED_JOBS else "FINISHED"
        finally:
            tracking.finish_parent_run(config, self.parent_id, status,
                                       [path for path in outputs if path], tags)
            self.parent_id = None


def best_job(rows: list[dict], workloads: list[Workload]) -> dict:
    """The finished job with the highest headline metric, as the parent's tags
    ``kspipe.best_job`` and ``kspipe.best_run`` (said on screen too); none if none finished."""
    from kspipe.reporting import say

    done = [(row[w.headline], row) for row, w in zip(rows, workloads)
            if row["status"] == "FINISHED" and row.get(w.headline) is not None]
    if not done:
        return {}
    value, row = max(done, key=lambda pair: pair[0])
    metric = workloads[rows.index(row)].headline
    say(f"best: {row['job']}: {metric} {value:.3f} (run {row['run_id']})")
    return {"kspipe.best_job": row["job"], "kspipe.best_run": row["run_id"]}


def unique(items) -> list:
    """``items`` without repeats, in first-seen order."""
    return list(dict.fromkeys(items))


def comparison_columns(jobs: list, workloads: list[Workload]) -> list[str]:
    """The metrics compared: per workload its headline, ``<headline>_ci95`` (where a job
    reported it), its summary metrics and its rate; the union over the sweep's workloads."""
    reported = {name for job in jobs for name in job.metrics}
    columns = []
    for workload in unique(workloads):
        ci = workload.headline + "_ci95"
        columns += [workload.headline, ci if ci in reported else "", *workload.shown(),
                    workload.rate]
    return [name for name in unique(columns) if name]


def comparison_row(job, swept: list[str], workload: Workload, columns: list[str]) -> dict:
    """One job of the sweep, named by its values of the swept keys."""
    if swept and all(k in job.params for k in swept):
        name = ", ".join(f"{k}={job.params[k]}" for k in swept)
    else:  # a swept config group (+experiment=a,b) is no param: the run's name has it
        name = job.name or job.run_id
    row = {"job": name, "run_id": job.run_id, "status": job.status, "workload": workload.name}
    row.update({key: job.metrics.get(key) for key in columns})
    return row


def write_table(rows: list[dict], columns: list[str], path: str) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["job", "run_id", "status", "workload", *columns])
        writer.writeheader()
        writer.writerows(rows)
    return path


def label(metric: str) -> str:
    """A metric's name for an axis: ``tasks_per_s`` is ``tasks/s``."""
    return metric.replace("_per_s", "/s").replace("_", " ")


def plot_comparison(rows: list[dict], workloads: list[Workload], path: str) -> str | None:
    """Two panels, one bar per job that reported its headline: the headline (error bar
    ``<headline>_ci95``) and the rate.  None if no job reported its headline."""
    done = [(r, w) for r, w in zip(rows, workloads) if w.headline and r.get(w.headline) is not None]
    if not done:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len(unique(w.name for _, w in done)) > 1
    labels = [r["job"] + (f" [{w.name}]" if several else "") for r, w in done]
    scores = [r[w.headline] for r, w in done]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.6 * len(done) + 2))
    left.barh(labels, scores, color="tab:blue",
              xerr=[r.get(w.headline + "_ci95") or 0 for r, w in done])
    left.set_xlabel(" / ".join(label(m) for m in unique(w.headline for _, w in done)))
    if all(0 <= s <= 1 for s in scores):  # accuracies, AUCs: the whole scale
        left.set_xlim(0, 1)
    right.barh(labels, [(r.get(w.rate) if w.rate else None) or 0 for r, w in done],
               color="tab:orange")
    right.set_xlabel(" / ".join(label(m) for m in unique(w.rate for _, w in done if w.rate)))
    right.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
