"""The ``mlflow`` plugin: a run's record in MLflow, kept by the first worker only.

A run (:class:`MlflowTracker`) is named by its experiment and the overrides the user gave
(a sweep's job by its swept values), gets the resolved config of the groups it reads
(:attr:`kspipe.contracts.Workload.groups`) as params, its command line (``kspipe.command``),
its workload's name and metrics as tags (:mod:`kspipe.observers.mlflow.tags`), every metric
the stages report, the resolved config, the inference model and a learning-curve PNG of
the ``curve/*`` series (:mod:`kspipe.observers.plots`) as artifacts, the inference model as
the MLflow model ``model`` with the run's final ``test_*`` metrics
(:mod:`kspipe.observers.mlflow.serving`; registered as ``tracking.register`` if
set, that version given the alias ``tracking.alias``), the data set it trained on as its
input (the dataset stage's ``training_data``, :class:`kspipe.contracts.TrainingData`), and
ends FINISHED, FAILED or KILLED, a failed run with its reason in one line (the tag
``kspipe.error``); a job that Slurm requeues, or whose pod Kubernetes restarts, goes on in
its earlier run (:mod:`kspipe.observers.mlflow.earlier_runs`).  A job that a process runs
itself makes its run just before its execute stage: a job refused before (its data, its
programs) leaves none.
Unless ``tracking.system_metrics=false``, every process that plays a part in the job (the
one of a local run; each worker and server of a cluster, as ``worker0``, ``server1``...) has
its recorder sample its CPU, memory and network into the run every
``tracking.system_metrics_interval`` seconds (:mod:`kspipe.observers.mlflow.system`).  Its
last line names the command that opens the runs page of the experiment
(:func:`kspipe.observers.mlflow.store.runs_page`).

The record is written by a process of its own (:mod:`kspipe.observers.mlflow.recorder`), so the
job's process neither imports MLflow nor waits for its store; in a sweep, the run becomes
a child of its sweep's parent run
(:func:`kspipe.observers.mlflow.sweep_runs.parent_run_id`).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time

from omegaconf import open_dict

from kspipe import hookimpl, job
from kspipe.contracts import Workload
from kspipe.errors import ConfigError, KspipeError, check_number, first_line
from kspipe.observers.mlflow.earlier_runs import JOB_TAG
from kspipe.observers.mlflow.recorder import Recorder
from kspipe.observers.mlflow.store import runs_page, tracking_uri
from kspipe.observers.mlflow.sweep_runs import parent_run_id
from kspipe.observers.mlflow.tags import workload_tags
from kspipe.reporting import say

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


def model_metrics(metrics: dict) -> dict:
    """What the run's MLflow model carries of its final ``metrics``: its evaluation on the
    held-out data, the metrics named ``test_*`` (Reptile's ``test_accuracy`` and its
    interval, ctr's ``test_auc`` and ``test_logloss``).  A baseline (the model before
    training) stays on the run."""
    return {k: float(v) for k, v in metrics.items() if k.startswith("test_")}


def node_id(role) -> str | None:
    """The name of a process's system metrics in its run: none for the one process of a
    local run, else its role and index (``worker0``, ``server1``)."""
    if role.mode == "local":
        return None
    return f"server{role.server_index()}" if role.is_server() else f"worker{role.worker_index()}"


class MlflowTracker:
    """The tracking plugin; one instance per plugin manager.  The run's workload comes
    with ``kspipe_run_start``, as the pipeline described it once for the run.

    The record is written by a :class:`~kspipe.observers.mlflow.recorder.Recorder` process,
    which opens the store beside the dataset and program stages; the run is made just
    before the execute stage, which waits for it (a store that cannot be opened stops the
    job there, before training; a job refused before leaves no run), a cluster job's when
    it launches its processes (they inherit the run's id).  The first worker records the
    run (``records``); a cluster's other processes have a recorder that only samples their
    system metrics, which never stops or holds up their part in the job."""

    def __init__(self):
        self.recorder: Recorder | None = None
        self.run_id = None
        self.experiment = None
        self.owner = False
        self.records = False  # this process records the run (else it only samples itself)
        self.workload: Workload | None = None
        self.unmade = None  # (cfg, run_dir) of the run made before the execute stage
        self.held: list = []  # the requests made before it (data set, system metrics)

    @hookimpl
    def kspipe_check_config(self, cfg):
        t = cfg.tracking
        if not t.enabled:
            return
        check_number(t.system_metrics_interval, "tracking.system_metrics_interval", 0, True)
        if t.get("alias") and not t.get("register"):
            raise ConfigError(
                f"tracking.alias={t.alias} names the model version tracking.register "
                f"registers: set tracking.register=<name> too"
            )
        if t.get("register") and not t.get("model", True):
            raise ConfigError(
                f"tracking.register={t.register} registers the run's MLflow model, which "
                f"tracking.model=false does not log"
            )

    @hookimpl
    def kspipe_run_start(self, cfg, role, run_dir, workload):
        self.workload = workload
        if not cfg.tracking.enabled:
            return
        given = cfg.tracking.get("run_id")  # the command that started this process made it
        samples = cfg.tracking.system_metrics and not role.is_cluster_job
        self.records = role.is_first_worker()
        if not self.records and not (samples and given):
            return
        self.owner = self.records and (not given or role.is_cluster_job)
        self.recorder = Recorder.take()
        if self.owner and not role.is_cluster_job:  # made before the execute stage
            self.recorder.send("connect", tracking_uri(cfg), cfg.tracking.experiment)
            self.unmade = (cfg, run_dir)
        else:
            create = self.new_run(cfg, run_dir) if self.owner else None
            self.recorder.ask(
                "open",
                tracking_uri(cfg),
                cfg.tracking.experiment,
                None if self.owner else given,
                create,
            )
        if samples:
            interval = float(cfg.tracking.system_metrics_interval)
            self.request("system_metrics", os.getpid(), node_id(role), interval)
        if role.is_cluster_job:
            self.opened()
            with open_dict(cfg):  # the job's processes read it from their job.yaml
                cfg.tracking.run_id = self.run_id

    def new_run(self, cfg, run_dir: str) -> dict:
        """What the recorder makes the run with: name, tags, params, the resolved config
        (saved in the run folder), the registry name, the run it starts from, and for a
        job that its scheduler may start again, this attempt (an earlier attempt's run goes
        on: :mod:`kspipe.observers.mlflow.earlier_runs`)."""
        from omegaconf import OmegaConf

        tags = {
            "kspipe.mode": cfg.mode,
            "kspipe.run_dir": run_dir,
            "kspipe.command": shlex.join(["kspipe", *sys.argv[1:]])[:MAX_PARAM_LENGTH],
            **workload_tags(self.workload),
        }
        if parent_run_id():
            tags["mlflow.parentRunId"] = parent_run_id()
        attempt, restart = job.attempt(cfg), None
        if attempt is not None:  # its scheduler may start it again: one run for all attempts
            tags[JOB_TAG] = attempt.job
            restart = {"restarts": attempt.restarts, "resumed_from": cfg.get("resume")}
        resolved = OmegaConf.to_container(cfg, resolve=True)
        config_path = os.path.join(run_dir, "config.yaml")
        OmegaConf.save(cfg, config_path, resolve=True)
        groups = set(self.workload.groups or resolved)  # the config groups the run reads
        params = {k: v for k, v in resolved.items() if k in groups or not isinstance(v, dict)}
        return {
            "run_name": cfg.tracking.run_name or self.workload.name,
            "tags": tags,
            "params": [(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in flatten(params).items()],
            "config_path": config_path,
            "register": cfg.tracking.get("register"),
            "alias": cfg.tracking.get("alias"),
            "source": cfg.get("evaluate") or cfg.get("init_from"),
            "restart": restart,
        }

    def make_run(self) -> None:
        """Ask the recorder for the run this process makes, held since the run's start
        (the job has not been refused), then for what was held with it."""
        if self.unmade is None:
            return
        (cfg, run_dir), self.unmade = self.unmade, None
        held, self.held = self.held, []
        if self.recorder is None:
            return
        create = self.new_run(cfg, run_dir)
        self.recorder.ask("open", tracking_uri(cfg), cfg.tracking.experiment, None, create)
        for name, args in held:
            self.request(name, *args)

    def opened(self) -> None:
        """Wait for the recorder to have opened the run (its error raised here)."""
        if self.recorder is not None and self.run_id is None:
            try:
                self.run_id, self.experiment = self.recorder.answer()
            except (EOFError, OSError) as err:  # the recorder died: the job goes on
                if self.records:
                    say(f"the run is not recorded in MLflow ({first_line(err)})")
                self.close()
            except BaseException as err:
                self.close()
                if self.records or not isinstance(err, Exception):
                    raise  # else the first worker says it

    @hookimpl
    def kspipe_before_stage(self, stage, cfg):
        if stage == "execute" and self.records:
            self.make_run()
            self.opened()

    @hookimpl
    def kspipe_after_stage(self, stage, cfg, result):
        data = getattr(result, "training_data", None) if stage == "dataset" else None
        if data is not None and self.records:
            self.request("dataset", dataclasses.asdict(data))

    @hookimpl
    def kspipe_log_metrics(self, metrics, step):
        if not self.records:
            return
        self.request(
            "metrics", {k: float(v) for k, v in metrics.items()}, step, int(time.time() * 1000)
        )

    @hookimpl
    def kspipe_log_artifact(self, path, artifact_path):
        if not self.records:
            return
        self.request("artifact", os.path.abspath(path), artifact_path or None)

    def request(self, name: str, *args) -> None:
        if self.recorder is None:
            return
        if self.unmade is not None:  # sent once the run is made
            self.held.append((name, args))
            return
        try:
            self.recorder.send(name, *args)
        except OSError as err:  # the recorder died: the job goes on
            if self.records:
                say(
                    f"the run's MLflow record stops here (its recorder process ended: "
                    f"{first_line(err)})"
                )
            self.close()

    @hookimpl
    def kspipe_run_end(self, cfg, metrics, run_dir):
        self.make_run()
        self.opened()
        if self.recorder is None:
            return
        if not self.records:  # its sampling ends
            self.finish("FINISHED")
            return
        model = self.model(cfg, run_dir, metrics) if self.owner else None
        note = self.finish("FINISHED", run_dir, self.workload.headline, model)
        if note:
            say(note)
        if self.owner and not parent_run_id():  # a sweep names the page
            say(runs_page(cfg, self.experiment, self.workload.headline))  # once, at its end

    def model(self, cfg, run_dir: str, metrics: dict | None) -> dict | None:
        """log_model's arguments for the run's inference model, if its workload names a
        predictor (a refused ``tracking.register`` then fails the run; a model that cannot
        be logged otherwise is said in one line and the trained run is kept), with its
        metrics (:func:`model_metrics`)."""
        serving = self.workload.serving
        if (
            not serving
            or not cfg.tracking.get("model", True)
            or not os.path.isdir(os.path.join(run_dir, "inference_model"))
        ):
            return None
        return {
            "uri": tracking_uri(cfg),
            "run_id": self.run_id,
            "run_dir": run_dir,
            "serving": serving,
            "register": cfg.tracking.get("register"),
            "alias": cfg.tracking.get("alias"),
            "metrics": model_metrics(metrics or {}),
        }

    @hookimpl
    def kspipe_run_error(self, cfg, error):
        if self.unmade is not None:  # refused before its execute stage: no run is made
            self.close()
            return
        try:
            self.opened()
        except Exception:  # the store never opened: there is no run to end
            return
        if self.recorder is None:
            return
        status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        self.finish(status, None, "", None, error_line(error))

    def finish(self, status: str, *args):
        """The run's end, told to the recorder and waited for; the recorder then stops."""
        try:
            self.recorder.ask("finish", status, *args)
            return self.recorder.answer()
        except (OSError, EOFError) as err:
            if self.records:
                say(
                    f"the run's MLflow record was not ended {status} (its recorder process "
                    f"ended: {first_line(err)})"
                )
        except Exception:
            if self.records:
                raise  # else the first worker says what its own recorder met
        finally:
            self.close()

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        self.recorder, self.run_id, self.unmade, self.held = None, None, None, []


def error_line(error: BaseException) -> str:
    """Why a run failed, as its tag ``kspipe.error`` keeps it: the one line the user was
    told (a stop's signal; another error's type too)."""
    if isinstance(error, KeyboardInterrupt):
        return f"stopped by {getattr(error, 'name', 'SIGINT')}"
    if isinstance(error, KspipeError):
        return first_line(error)
    return f"{type(error).__name__}: {first_line(error)}"
