"""A sweep's runs in MLflow: the parent run, its children read back as plain records, its end.

:func:`start_parent_run` makes the parent and names it in ``KSPIPE_PARENT_RUN_ID``, whose
runs (the ``mlflow`` observer's, :mod:`kspipe.observers.mlflow.tracking`) become its children;
:func:`child_runs` reads them back as :class:`RunRecord` values and
:func:`finish_parent_run` attaches the comparison and ends the parent.  Called by the
sweep's callback (:mod:`kspipe.observers.sweep`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kspipe.contracts import Workload
from kspipe.observers.mlflow.store import client_for, experiment_id, runs_page
from kspipe.observers.mlflow.tags import workload_from_tags
from kspipe.reporting import say

#: The sweep's parent run, named to the runs of its jobs (in this process or the ones it starts).
PARENT_RUN_ENV = "KSPIPE_PARENT_RUN_ID"


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


def parent_run_id() -> str | None:
    """The sweep's parent run of the job this process runs, if it is a sweep's: the one
    place its id crosses into the jobs' processes (Hydra's launchers start them with this
    process's environment)."""
    return os.environ.get(PARENT_RUN_ENV) or None


#: The parent run this process made and has not ended yet: (config, run id), or None.
_open: tuple | None = None


def start_parent_run(cfg, run_name: str, tags: dict) -> str:
    """Create a sweep's parent run and name it in ``KSPIPE_PARENT_RUN_ID``, so the runs of
    the jobs (in this process or the ones it starts) become its children; return its id."""
    global _open
    client = client_for(cfg)
    run = client.create_run(
        experiment_id(client, cfg.tracking.experiment), run_name=run_name, tags=tags
    )
    os.environ[PARENT_RUN_ENV] = run.info.run_id
    _open = (cfg, run.info.run_id)
    return run.info.run_id


def end_unfinished_parent(status: str) -> bool:
    """End the parent run this process made with ``status`` (``KILLED``, ``FAILED``), if a
    stop or a failure cut the sweep short before its end (Hydra then calls no callback):
    no run is left RUNNING.  As far as the store allows, quietly: the command is already
    saying why it stops.  Whether it was ended."""
    global _open
    if _open is None:
        return False
    (cfg, parent_id), _open = _open, None
    try:
        client_for(cfg).set_terminated(parent_id, status)
        return True
    except Exception:
        return False
    finally:
        if os.environ.get(PARENT_RUN_ENV) == parent_id:
            del os.environ[PARENT_RUN_ENV]


def child_runs(cfg, parent_id: str) -> list[RunRecord]:
    """The runs of the sweep ``parent_id``, first started first."""
    client = client_for(cfg)
    found = client.search_runs(
        [client.get_run(parent_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
        order_by=["attributes.start_time ASC"],
    )
    return [
        RunRecord(
            run_id=run.info.run_id,
            name=run.info.run_name,
            status=run.info.status,
            params=dict(run.data.params),
            metrics=dict(run.data.metrics),
            workload=workload_from_tags(run.data.tags),
        )
        for run in found
    ]


def finish_parent_run(cfg, parent_id: str, status: str, artifacts=(), tags=None) -> None:
    """Attach ``artifacts`` (files) and ``tags`` to the parent run and end it with ``status``
    (``FINISHED`` or ``FAILED``); ``KSPIPE_PARENT_RUN_ID`` is cleared whatever happens."""
    global _open
    _open = None
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
