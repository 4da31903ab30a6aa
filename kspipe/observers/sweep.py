"""Hydra sweeps (``kspipe -m``): the callback that records a sweep and compares its jobs.

A hyperparameter search (``hydra/sweeper=optuna``) is such a sweep: each trial is a job
whose value is its workload's headline metric, and the parent names the best trial.

:class:`SweepCallback` (``hydra.callbacks.sweep`` in the config) has
:mod:`kspipe.observers.mlflow.sweep_runs` create the parent run when the sweep starts; every
job's run becomes its child.  A job that fails is reported on one line and recorded (its
child run FAILED); the others still run.  At the end the parent gets ``comparison.csv``
and ``comparison.png``: per job, the metrics its workload declares
(:class:`kspipe.contracts.Workload`, as the job's run recorded it: the headline, with
``<headline>_ci95`` as error bar where reported, the rate and the summary metrics; the
union of them when the jobs ran different workloads).  The parent ends FAILED if any job
failed, and the command exits non-zero.

A search's trial that fails raises :class:`TrialFailed` to Hydra, whose sweeper records the
trial FAILED (not as a value) and goes on while no more than ``hydra.sweeper.max_failure_rate``
of a batch of ``hydra.sweeper.n_jobs`` trials failed (kspipe's default, 1.0: whatever
fails).  A search that runs to its end is a search done: its parent ends FINISHED and the
command exits 0, the failed trials said in one line.  One that its failures end
(:func:`failed_search`) ends FAILED, in one line.

Which keys a sweep varies, and a job's name from them, are read from the overrides by
Hydra's own parser (:func:`parse_overrides`), here and in the command's checks.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

from hydra.experimental.callback import Callback

from kspipe.contracts import Workload
from kspipe.errors import KspipeError, print_error
from kspipe.observers.mlflow import sweep_runs
from kspipe.observers.mlflow.tags import workload_tags
from kspipe.observers.plots import plot_comparison


def parse_overrides(overrides) -> list | None:
    """``overrides`` (``key=value`` strings) as Hydra reads them (its ``Override``
    objects); None if Hydra refuses one (composing the config then names the mistake)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return None


def swept_keys(overrides) -> list[str]:
    """Keys of the overrides that sweep (``workers=1,2``, ``range(...)``, ``interval(...)``
    ...), without Hydra's own (``hydra.*``)."""
    return [
        override.get_key_element().lstrip("+~")
        for override in parse_overrides(overrides) or ()
        if override.is_sweep_override() and not override.is_hydra_override()
    ]


def job_label(overrides, swept: list[str]) -> str | None:
    """A sweep job's name from its overrides and the keys ``swept``: ``mode=pserver,workers=2``."""
    chosen = [
        override.input_line.lstrip("+~")
        for override in parse_overrides(overrides) or ()
        if override.get_key_element().lstrip("+~") in swept
    ]
    return ",".join(chosen) or None


class JobFailed(float):
    """What a sweep's job that failed returns: the worst value (a hyperparameter search goes
    on) that carries the one line saying why, for :meth:`SweepCallback.on_job_end`."""

    def __new__(cls, value: float, reason: str):
        failed = super().__new__(cls, value)
        failed.reason = reason
        return failed

    def __reduce__(self):  # a job process of another launcher sends it back pickled
        return JobFailed, (float(self), self.reason)


class TrialFailed(KspipeError):
    """What a trial of a hyperparameter search that failed raises to Hydra (having said why
    in one line): Hydra records its job FAILED, and the sweeper its trial (no value)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __reduce__(self):  # a job process of another launcher sends it back pickled
        return TrialFailed, (self.reason,)


def is_search(hydra_cfg) -> bool:
    """Whether the sweep ``hydra_cfg`` (Hydra's config) runs is a hyperparameter search:
    its sweeper Hydra's optuna sweeper, which takes a trial that raises as a failed one."""
    return str((hydra_cfg.get("sweeper") or {}).get("_target_", "")).endswith(".OptunaSweeper")


class SweepCallback(Callback):
    """One sweep's record.  Hydra makes it from the config and gives it nothing else, so it
    learns what it needs from the sweep's config (the keys swept, its sweeper), the jobs'
    returns in this process (:class:`JobFailed`, :class:`TrialFailed`) and the jobs' runs
    (their workloads and statuses)."""

    def __init__(self):
        self.parent_id = None
        self.swept: list[str] = []
        self.failed: list[str] = []  # "<job>: <why>", one per job that failed
        self.ended = 0  # jobs ended in this process
        self.search = False  # a hyperparameter search (is_search)
        self.config = None
        self.earlier_jobs: set = set()  # Slurm jobs in the sweep's submitit folder before it

    def on_multirun_start(self, config, **kwargs) -> None:
        global _running
        self.swept = swept_keys(config.hydra.overrides.task)
        self.failed, self.ended, self.search = [], 0, is_search(config.hydra)
        self.config, _running = config, self
        self.earlier_jobs = set(self.submitted_jobs())
        if self.search:  # optuna's own info lines ("A new study created in memory ...")
            quiet_optuna()  # say nothing of the user's job
        if not config.tracking.enabled:
            return
        sweep = ", ".join(f"{k}={v}" for k, v in (config.hydra.sweeper.params or {}).items())
        overrides = " ".join(config.hydra.overrides.task)
        self.parent_id = sweep_runs.start_parent_run(
            config,
            f"sweep {overrides}",
            {"kspipe.sweep": "parent", "kspipe.overrides": overrides, "kspipe.sweep_params": sweep},
        )

    def on_job_end(self, config, job_return, **kwargs) -> None:
        self.ended += 1
        # what the job returned or raised: Hydra's public property, for a job that raised,
        # prints a line of Hydra's own and raises it
        ended = job_return._return_value
        if isinstance(ended, (JobFailed, TrialFailed)):
            self.failed.append(ended.reason)

    def on_multirun_end(self, config, **kwargs) -> None:
        global _running
        _running = None
        try:
            if self.parent_id is not None:
                self.finish(config)
        finally:
            self.parent_id = None
            if self.failed and self.search:  # the sweeper went on: the search is done
                from kspipe.reporting import say

                say(
                    f"{len(self.failed)} trial(s) of the search failed, recorded FAILED "
                    f"(hydra.sweeper.max_failure_rate={config.hydra.sweeper.max_failure_rate}): "
                    f"{'; '.join(self.failed)}"
                )
            elif self.failed:
                # Hydra hands nothing back to the command that started it: the sweep's end is
                # where the command learns that jobs failed, so it exits here
                print_error(
                    f"{len(self.failed)} job(s) of the sweep failed: {'; '.join(self.failed)}"
                )
                sys.exit(1)

    def finish(self, config, cut_short: bool = False) -> None:
        """Compare the jobs on the parent run, count the jobs another launcher ran that
        failed (submitit's Slurm jobs), and end the parent: FAILED if jobs failed (a
        search's trials only where they ended it, ``cut_short``)."""
        status, outputs, tags = "FAILED", [], {}
        try:
            jobs = [job for job in sweep_runs.child_runs(config, self.parent_id) if job.workload]
            workloads = [job.workload for job in jobs]
            folder = os.path.join(config.hydra.sweep.dir, "comparison")
            os.makedirs(folder, exist_ok=True)
            columns = comparison_columns(jobs, workloads)
            rows = [comparison_row(job, self.swept, w, columns) for job, w in zip(jobs, workloads)]
            outputs = [
                write_table(rows, columns, os.path.join(folder, "comparison.csv")),
                plot_comparison(rows, workloads, os.path.join(folder, "comparison.png")),
            ]
            if workloads:  # the first job's workload; the names of all the sweep ran
                tags = {
                    **workload_tags(workloads[0]),
                    "kspipe.workload": ",".join(unique(w.name for w in workloads)),
                }
            tags.update(best_job(rows, workloads))
            counted = {failure.partition(":")[0] for failure in self.failed}
            self.failed += [
                f"{r['job']}: its run ended {r['status']}"
                for r in rows
                if r["status"] != "FINISHED" and str(r["job"]) not in counted
            ]
            status = "FAILED" if cut_short or (self.failed and not self.search) else "FINISHED"
        finally:
            sweep_runs.finish_parent_run(
                config, self.parent_id, status, [path for path in outputs if path], tags
            )

    def submitted_jobs(self) -> list[str]:
        """The Slurm jobs in the folder where submitit's Slurm launcher keeps its jobs' files
        (``hydra.launcher.submitit_folder``: a folder ``<job>`` or ``<job>_<task>`` each);
        none for another launcher."""
        launcher = self.config.hydra.get("launcher") or {}
        if not str(launcher.get("_target_", "")).endswith(".SlurmLauncher"):
            return []
        from submitit.core.utils import JobPaths

        folder = JobPaths.get_first_id_independent_folder(str(launcher.submitit_folder))
        if not os.path.isdir(folder):
            return []
        return [
            entry.name.partition("_")[0]
            for entry in os.scandir(folder)
            if entry.is_dir() and entry.name.partition("_")[0].isdigit()
        ]

    def cancel_jobs(self) -> list[str]:
        """Cancel this sweep's Slurm jobs still queued or running (``scancel``: Slurm sends a
        running one SIGTERM, and kspipe's job stops at its next safe point); the ones
        cancelled."""
        ours = set(self.submitted_jobs()) - self.earlier_jobs
        if not ours or not shutil.which("squeue"):
            return []
        queue = subprocess.run(
            ["squeue", "-h", "-o", "%F"], capture_output=True, text=True, timeout=60
        )
        jobs = sorted(ours & set(queue.stdout.split()), key=int)
        if (
            not jobs
            or subprocess.run(["scancel", *jobs], capture_output=True, timeout=60).returncode
        ):
            return []
        return jobs


#: The sweep this process runs, from its start to its end.
_running: SweepCallback | None = None


def cut_short(status: str) -> str:
    """End the sweep this process runs, which a stop (``KILLED``) or a failure (``FAILED``)
    cut short, so that Hydra calls no callback: on a stop, the Slurm jobs the command was
    waiting for are cancelled (after a failure, they go on: a job that failed does not stop
    the others); the parent run ends ``status``.  Returns what the command's last line
    adds."""
    global _running
    sweep, _running = _running, None
    cancelled = []
    try:
        if sweep is not None and status == "KILLED":
            cancelled = sweep.cancel_jobs()
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        ended = sweep_runs.end_unfinished_parent(status)
    said = f"; the sweep's parent run is recorded as {status}" if ended else ""
    if cancelled:
        said += (
            f"; its Slurm jobs still queued or running ({', '.join(cancelled)}) are "
            f"cancelled (a running one stops at its next safe point)"
        )
    return said


def failed_search(err: Exception) -> KspipeError | None:
    """The search this process runs, ended by its failed trials, as the command's one line,
    its parent run given the comparison and ended FAILED; None where ``err`` is another
    failure.  The sweeper ends a search by raising a failed trial's :class:`TrialFailed`
    (more than ``hydra.sweeper.max_failure_rate`` of a batch failed), and optuna's
    ``ValueError`` where every trial failed (no best)."""
    global _running
    sweep = _running
    if sweep is None or not sweep.search or not sweep.failed:
        return None
    every = isinstance(err, ValueError) and len(sweep.failed) == sweep.ended
    if not (isinstance(err, TrialFailed) or every):
        return None
    _running = None
    said = ""
    if sweep.parent_id is not None:
        sweep.finish(sweep.config, cut_short=True)
        said = "; the search's parent run is recorded as FAILED"
    settings = sweep.config.hydra.sweeper
    why = (
        f"the search has no best trial: all {len(sweep.failed)} failed"
        if every
        else f"the search ended: more than hydra.sweeper.max_failure_rate="
        f"{settings.max_failure_rate} of a batch of hydra.sweeper.n_jobs={settings.n_jobs} "
        f"trials failed"
    )
    return KspipeError(f"{why}: {'; '.join(sweep.failed)}{said}")


def best_job(rows: list[dict], workloads: list[Workload]) -> dict:
    """The finished job with the highest headline metric, as the parent's tags
    ``kspipe.best_job`` and ``kspipe.best_run`` (said on screen too); none if none finished."""
    from kspipe.reporting import say

    done = [
        (row[w.headline], row)
        for row, w in zip(rows, workloads)
        if row["status"] == "FINISHED" and row.get(w.headline) is not None
    ]
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
        columns += [
            workload.headline,
            ci if ci in reported else "",
            *workload.shown(),
            workload.rate,
        ]
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


def quiet_optuna() -> None:
    """Optuna logs each study it makes at INFO on the terminal; its warnings still show."""
    import warnings

    with warnings.catch_warnings():  # SQLAlchemy 2's note on optuna 2's storage module
        warnings.simplefilter("ignore", DeprecationWarning)
        import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
