"""Runs found again by their tags: the run that wrote a run folder (:func:`source_run_id`,
by its ``kspipe.run_dir``), and the run of a job that its scheduler started again.

A job that its scheduler starts again stays one MLflow run.

Slurm requeues a ``--requeue`` job (``scontrol requeue``, a preemption, a node lost) and
Kubernetes restarts a ``PaddleJob``'s pod: the job's process starts again from the
beginning, in the same run folder (a requeued Slurm job resumes from its newest checkpoint
there).  Its first attempt's run ended (KILLED or FAILED; FINISHED if the job was done); the
new attempt finds that run (:func:`earlier_run`: the tags ``kspipe.job``, the job's key of
:class:`kspipe.job.Attempt`, and ``kspipe.run_dir``) and goes on recording into it
(:func:`reopen`): RUNNING again, its metrics from the checkpoint's step on (a step the run
already holds is not logged again: :func:`logged_steps`), its params as the first attempt
logged them (MLflow keeps a param's first value), ``kspipe.restarts``
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
#: The metrics logged at every step they come with: the job's restart count (a step each)
#: and the processes' samples (their own recorder, a count of their own).
REPEATABLE, REPEATABLE_PREFIX = ("restarts",), "system/"


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


def logged_steps(run) -> dict[str, int]:
    """Each metric's highest step in ``run`` as the recorder opens it: none for a new run;
    for a run an earlier attempt recorded (a scheduler's restart, or ``cluster.max_restarts``
    starting the job's processes again in the launcher's run), the steps that attempt
    reached.  The attempt resumed from a checkpoint before them trains those steps again,
    and their points are not logged twice (:func:`unlogged`).  MLflow keeps a metric's
    latest value at its highest step, so the run as opened says it in one request, with
    no metric history read."""
    return {
        m.key: m.step
        for m in run.data.to_proto().metrics
        if m.key not in REPEATABLE and not m.key.startswith(REPEATABLE_PREFIX)
    }


def unlogged(logged: dict[str, int], metrics: dict, step: int | None) -> dict:
    """``metrics`` at ``step`` but those an earlier attempt logged at that step or after
    (``logged``: :func:`logged_steps`).  The first attempt's value stays: a sync job's
    repeated step is the same computation from the same checkpoint (a restarted job reaches
    the uninterrupted run's weights bit for bit), its timings were that step's own, and
    MLflow cannot replace a logged point, only add another at the same step; an async
    job's repeated steps can differ, and keep the first attempt's too."""
    if step is None or not logged:
        return metrics
    return {k: v for k, v in metrics.items() if k not in logged or step > logged[k]}
