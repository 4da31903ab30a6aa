"""Runs found again by their tags: the run that wrote a run folder (:func:`source_run_id`,
by its ``kspipe.run_dir``), and the run of a job that its scheduler started again.

A job that its scheduler starts again stays one MLflow run.

Slurm requeues a ``--requeue`` job (``scontrol requeue``, a preemption, a node lost) and
Kubernetes restarts a ``PaddleJob``'s pod: the job's process starts again from the
beginning, in the same run folder (a requeued Slurm job resumes from its newest checkpoint
there).  Its first attempt's run ended (KILLED or FAILED; FINISHED if the job was done); the
new attempt finds that run (:func:`earlier_run`: the tags ``kspipe.job``, the job's key of
:class:`kspipe.job.Attempt`, and ``kspipe.run_dir``) and goes on recording into it
(:func:`reopen`): RUNNING again, its metrics from the checkpoint's step on, its params as
the first attempt logged them (MLflow keeps a param's first value), ``kspipe.restarts``
counting the attempts before, and ``kspipe.resumed_from`` naming the checkpoint.  The run is
found only when the job is started again: a new job never takes a run, even one of its run
folder.
"""

from __future__ import annotations

import os

from kspipe.files import user_path
from kspipe.reporting import say

#: The tags of a job that its scheduler may start again.
JOB_TAG, RESTARTS_TAG, RESUMED_TAG = "kspipe.job", "kspipe.restarts", "kspipe.resumed_from"


def source_run_id(client, path: str) -> str | None:
    """The run that wrote the run folder of ``path`` (a run folder or one of its
    checkpoints), found by its ``kspipe.run_dir`` tag; None where this store has none."""
    folder = os.path.abspath(user_path(path))
    while os.path.basename(folder).startswith(("checkpoint-", "worker-", "checkpoints")):
        folder = os.path.dirname(folder)
    if "'" in folder:
        return None  # not expressible in a filter string
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = (
        client.search_runs(experiments, f"tags.`kspipe.run_dir` = '{folder}'", max_results=1)
        if experiments
        else []
    )
    return found[0].info.run_id if found else None


def earlier_run(client, experiment_id: str, job: str, run_dir: str):
    """The newest run of the experiment that an attempt of ``job`` recorded for
    ``run_dir``; None where there is none."""
    if "'" in job + run_dir:
        return None  # not expressible in a filter string: the attempt records a run of its own
    found = client.search_runs(
        [experiment_id],
        f"tags.`{JOB_TAG}` = '{job}' and tags.`kspipe.run_dir` = '{run_dir}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return found[0] if found else None


def reopen(client, experiment_id: str, tags: dict, restart: dict) -> str | None:
    """The id of the earlier attempt's run, RUNNING again with this attempt's restart
    recorded, if this run is a restart of a job (``restart``: ``restarts``, the attempts
    before as the scheduler counts them, None where it does not; ``resumed_from``, the
    checkpoint it resumes from); else None, and the run is a new one.  Slurm's first
    attempt (``restarts`` 0) looks for none."""
    if restart["restarts"] == 0 or not tags.get(JOB_TAG):
        return None
    run = earlier_run(client, experiment_id, tags[JOB_TAG], tags["kspipe.run_dir"])
    if run is None:
        return None
    restarts = restart["restarts"]
    if restarts is None:  # the scheduler does not count: one more than the run has seen
        restarts = int(run.data.tags.get(RESTARTS_TAG) or 0) + 1
    run_id = run.info.run_id
    client.update_run(run_id, "RUNNING")
    client.set_tag(run_id, RESTARTS_TAG, str(restarts))
    if restart.get("resumed_from"):
        client.set_tag(run_id, RESUMED_TAG, str(restart["resumed_from"]))
    say(
        f"the job's MLflow run {run_id} goes on (restart {restarts}; it ended "
        f"{run.info.status} before)"
    )
    return run_id


def new_run_tags(restart: dict) -> dict:
    """The tags of a job's first recorded attempt: its restarts (0, unless the scheduler
    counts earlier attempts that recorded no run here)."""
    tags = {RESTARTS_TAG: str(restart["restarts"] or 0)}
    if restart["restarts"] and restart.get("resumed_from"):
        tags[RESUMED_TAG] = str(restart["resumed_from"])
    return tags
