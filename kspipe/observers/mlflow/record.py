"""The recorder process: ``python -m kspipe.observers.mlflow.record <requests> <answers>``,
started by :meth:`kspipe.observers.mlflow.recorder.Recorder.start`, writes a run's record
into the MLflow store, one request at a time, in the order the job's process makes them.

It imports MLflow while it waits for its first request, and ignores SIGINT and SIGTERM: the
job's process decides how the run ends and says so.  When the pipe closes before the run
has ended (the job's process died, even by SIGKILL), the run it made ends FAILED.  It
samples the job's process (:mod:`~kspipe.observers.mlflow.system`) and logs its data set.  A
tracking server that stops answering, or a store whose disk refuses a write, is said once;
meanwhile metrics and artifacts are dropped (:meth:`Record.call`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

from kspipe.errors import ConfigError, KspipeError, first_line
from kspipe.observers.mlflow import earlier_runs
from kspipe.observers.mlflow.earlier_runs import new_run_tags, reopen, source_run_id
from kspipe.observers.mlflow.store import (
    driver_error,
    is_server,
    probe_server,
    shown,
    write_refused,
)
from kspipe.reporting import say


class Record:
    """The run's record, in the recorder process: one request a method."""

    def __init__(self):
        self.client = None
        self.uri = None
        self.lost = False  # the tracking server stopped answering (said once)
        self.refused = None  # why the store refused a write (a full disk: said once)
        self.looked = 0.0  # when a lost server was last looked for
        self.plot = None  # the learning curve's picture, once drawn ("" for none)
        self.run_id = None
        self.experiment = None
        self.logged: dict[str, int] = {}  # each metric's highest step when the run opened
        self.owner = False
        self.ended = False
        self.curve: dict[str, list] = {}
        self.sampler = None  # the job's process's system metrics, while it runs
        self.unopened = None  # why the store could not be opened (said when the run opens)

    def prepare(self, uri: str) -> None:
        """Import what a store at ``uri`` needs, before the run is opened there."""
        with contextlib.suppress(Exception):  # opening the store will say what failed
            prepare(uri)

    def connect(self, uri: str, experiment: str) -> None:
        """The client on the store (made or migrated, its experiment found or made) before
        the run is made there; why it cannot be opened is said when the run is opened."""
        from omegaconf import OmegaConf

        from kspipe.observers.mlflow.store import client_for

        try:
            self.client = client_for(
                OmegaConf.create({"tracking": {"uri": uri, "experiment": experiment}})
            )
        except Exception as err:  # kspipe's one line (a server's: not "stopped answering")
            self.unopened = err
            return
        self.uri = uri

    def open(self, uri: str, experiment: str, run_id: str | None, create: dict) -> tuple:
        """The client on the store; the run ``run_id``, or, with ``run_id`` None, a new run
        made as ``create`` says.  Returns (run id, experiment id)."""
        if self.client is None and self.unopened is None:
            self.connect(uri, experiment)
        if self.unopened is not None:
            raise self.unopened
        if run_id is None:
            run_id = self.create(experiment, **create)
            self.owner = True
        self.run_id = run_id
        run = self.client.get_run(run_id)
        self.experiment, self.logged = run.info.experiment_id, earlier_runs.logged_steps(run)
        return run_id, self.experiment

    def create(
        self, experiment, run_name, tags, params, config_path, register, alias, source, restart
    ):
        from kspipe.observers.mlflow.store import experiment_id
        from mlflow.entities import Param

        if register:
            from kspipe.observers.mlflow import serving

            serving.check_registry_name(self.client, register, alias)
        if source:
            found = source_run_id(self.client, source)
            if found:
                tags = {**tags, "kspipe.source_run": found}
        experiment = experiment_id(self.client, experiment)
        if restart is not None:  # a job its scheduler started again: its earlier run goes on
            found = reopen(self.client, experiment, tags, restart)
            if found:
                return found
            tags = {**tags, **new_run_tags(restart)}
        run = self.client.create_run(experiment, run_name=run_name, tags=tags)
        params = [Param(k, v) for k, v in params]
        for start in range(0, len(params), 100):
            self.client.log_batch(run.info.run_id, params=params[start : start + 100])
        self.client.log_artifact(run.info.run_id, config_path)
        return run.info.run_id

    def call(self, name: str, args: tuple):
        """Carry out the request ``name``.  A tracking server that stops answering (MLflow's
        own retries would hold each request for minutes, and the job's end for all of
        them) is said once: meanwhile metrics and artifacts are dropped (a quick look every
        :data:`LOOK_EVERY_S` finds the server back), and any other request fails in one
        line, the run's end after a few seconds more.  A request is never made twice."""
        if name == "metrics":  # the learning curve has every point, recorded or not
            values, step = args[0], args[1]
            for k, v in values.items():
                self.curve.setdefault(k, []).append((step, v))
        if name == "finish":  # the curve's picture is the run folder's, whatever happens
            self.draw(*args[1:3])
        if self.lost:
            if name == "abandoned":  # the job is gone: nothing waits, nothing to say to
                return None
            if name in DROPPED and time.monotonic() < self.looked + LOOK_EVERY_S:
                return None
            self.looked = time.monotonic()
            try:
                probe_server(self.uri, waits=() if name in DROPPED else (1, 2, 4))
            except ConfigError:
                return self.unrecorded(name)
            self.lost = False
            say(f"the MLflow server at {shown(self.uri)} answers again")
        try:
            result = getattr(self, name)(*args)
        except Exception as err:
            why = None if is_server(self.uri or "") else write_refused(err)
            if why is not None:
                return self.not_written(name, why)
            if self.uri is None or not is_server(self.uri):
                raise
            try:
                probe_server(self.uri, waits=())
            except ConfigError:
                self.lost, self.looked = True, time.monotonic()
                if name in DROPPED:
                    say(
                        f"the MLflow server at {shown(self.uri)} stopped answering: the "
                        f"run's metrics and artifacts are not recorded until it answers "
                        f"again"
                    )
                return self.unrecorded(name)
            raise
        return result

    def not_written(self, name: str, why: str):
        """What the request ``name`` comes to when the store refuses to write it (``why``:
        its disk is full, read-only or failing): metrics and artifacts are dropped, said
        once (a store that refuses some writes may take others: those are recorded); any
        other request fails in one line."""
        if name in DROPPED and self.refused is None:
            self.refused = why
            say(
                f"the MLflow store at {shown(self.uri)} cannot be written ({why}): the "
                f"run's metrics and artifacts it refuses are not recorded there (its run "
                f"folder holds them all)"
            )
        if name == "abandoned":  # the job is gone, and has said why
            return None
        return self.unrecorded(name, why)

    def unrecorded(self, name: str, why: str = "the MLflow server stopped answering"):
        """What the request ``name`` comes to while the store cannot take it (the tracking
        server does not answer, or ``why``): nothing (metrics, artifacts, and a cluster's
        first worker's curve), else one line."""
        if name in DROPPED:
            return None
        if name == "finish" and not self.owner:
            self.ended = True
            return f"the learning curve was not recorded: {why}"
        what = (
            "the run was not ended there (it shows RUNNING); this run's folder holds its results"
            if name in ENDS
            else "the run could not be made there"
            if name == "open"
            else f"the run's {name} was not recorded"
        )
        raise ConfigError(f"tracking.uri={shown(self.uri)}: {why}; {what}")

    def draw(self, run_dir: str | None = None, headline: str = "") -> str | None:
        """The learning curve's picture in ``run_dir`` (once), its path; None without one."""
        if run_dir is None:
            return None
        if self.plot is None:
            from kspipe.observers.plots import learning_curve

            self.plot = (
                learning_curve(self.curve, os.path.join(run_dir, "learning_curve.png"), headline)
                or ""
            )
        return self.plot or None

    def system_metrics(self, pid: int, node_id: str | None, interval: float) -> None:
        """Sample the job's process ``pid`` into the run until it ends."""
        if self.run_id is not None:  # else the store never opened: the job says why
            from kspipe.observers.mlflow.system import Sampler

            self.sampler = Sampler(self.uri, self.run_id, pid, node_id, interval)
            self.sampler.start()

    def stop_sampling(self) -> None:
        """The job's process's last interval logged, and its sampling stopped."""
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            try:
                sampler.finish()
            except Exception as err:  # the run's end goes on
                say(f"the run's last system metrics were not recorded: {first_line(err)}")

    def dataset(self, data: dict) -> None:
        """The run's input: a :class:`kspipe.contracts.TrainingData` as a dict."""
        from kspipe.observers.mlflow.dataset import log_dataset

        if self.run_id is not None:
            log_dataset(self.client, self.run_id, **data)

    def metrics(self, metrics: dict, step: int, when_ms: int) -> None:
        from mlflow.entities import Metric

        new = earlier_runs.unlogged(self.logged, metrics, step)  # not an earlier attempt's
        batch = [Metric(k, v, when_ms, step) for k, v in new.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def artifact(self, path: str, artifact_path: str | None) -> None:
        if os.path.isdir(path):
            self.client.log_artifacts(self.run_id, path, artifact_path)
        else:
            self.client.log_artifact(self.run_id, path, artifact_path)

    def finish(self, status: str, run_dir=None, headline="", model=None, error=None) -> str | None:
        """The learning curve, the MLflow model (``model``: log_model's arguments) and the
        run's end (a failed run's reason, ``error``, as its tag ``kspipe.error``), as its
        owner; the first worker of a cluster logs the curve only.  Returns a line to say, if
        the model could not be logged."""
        note = None
        self.stop_sampling()
        plot = self.draw(run_dir, headline)
        if plot:
            self.client.log_artifact(self.run_id, plot)
        if not self.owner:
            self.ended = True
            return None
        if error:
            self.client.set_tag(self.run_id, ERROR_TAG, error[:MAX_TAG])
        try:
            if model:
                # the model's metrics at the step the run last logged them
                steps = [self.curve[k][-1][0] for k in model["metrics"] if self.curve.get(k)]
                note = log_model(**model, step=max(steps, default=0))
        except BaseException:
            self.end("FAILED")
            raise
        self.end(status)
        return note

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
        self.ended = True

    def abandoned(self) -> None:
        """The job's process is gone without ending the run: it failed."""
        self.stop_sampling()
        if self.owner and not self.ended:
            self.end("FAILED")


#: A failed run's reason, in one line (at most :data:`MAX_TAG` characters: MLflow's limit).
ERROR_TAG, MAX_TAG = "kspipe.error", 5000
#: The requests that end the run: with the tracking server gone, they fail in one line.
ENDS = ("finish", "end", "abandoned")
#: The requests dropped while the tracking server does not answer.
DROPPED = ("metrics", "artifact")
#: While the tracking server does not answer, it is looked for at most this often.
LOOK_EVERY_S = 10.0


def log_model(
    uri: str, run_id: str, run_dir: str, serving: str, register, alias=None, **scores
) -> str | None:
    """The run's MLflow model (:func:`kspipe.observers.mlflow.serving.log_model`), with Paddle's
    signal handlers taken off again (its import installs them); the line to say if a
    model could not be logged (a refused registration is the run's failure)."""
    import paddle

    from kspipe.observers.mlflow import serving as pyfunc

    paddle.disable_signal_handler()
    ignore_stop_signals()
    try:
        pyfunc.log_model(uri, run_id, run_dir, serving, register, alias, **scores)
    except KspipeError:
        raise
    except Exception as err:
        return f"the run's MLflow model was not logged ({serving}): {first_line(err)}"
    return None


def portable(err: BaseException) -> BaseException:
    """``err`` as the job's process can read it: kspipe's own errors as they are, any other
    as a :class:`KspipeError` with its first line."""
    if isinstance(err, KspipeError):
        return err
    return KspipeError(f"MLflow: {first_line(driver_error(err))}")


def ignore_stop_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def serve(requests: Connection, answers: Connection) -> None:
    """Carry out requests until the pipe closes.  A request that needs no answer and fails
    is said, each failure once."""
    record = Record()
    said = set()
    while True:
        try:
            name, args, wants_answer = requests.recv()
        except EOFError:
            record.call("abandoned", ())
            return
        try:
            result, error = record.call(name, args), None
        except Exception as err:
            result, error = None, portable(err)
        if wants_answer:
            answers.send((result, error))
        elif error is not None and (name, str(error)) not in said:
            said.add((name, str(error)))
            say(f"MLflow did not record the run's {name}: {str(error).removeprefix('MLflow: ')}")


def prepare(uri: str | None) -> None:
    """Import what opening a store at ``uri`` will (MLflow, and for a database its
    SQLAlchemy store: 2-4 s), before the first request comes; nothing is opened.  With no
    ``uri``, MLflow alone."""
    import mlflow  # noqa: F401

    if uri and not uri.startswith(("file:", "http:", "https:", "databricks")) and "://" in uri:
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


#: MLflow's settings for a tracking server, unless the user set them: its retries of a
#: refused request take about 30 s (a server restarting), not MLflow's four minutes (7
#: retries, backoff factor 2); a request that gets no answer gives up after 60 s; and the
#: run's end prints no "View run" and "View experiment" lines (kspipe says the runs page).
SERVER_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",  # a host gone silent: not 120 s a try
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def main(argv: list[str]) -> None:
    ignore_stop_signals()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for name, value in SERVER_SETTINGS.items():
        os.environ.setdefault(name, value)
    requests = Connection(int(argv[0]), writable=False)
    answers = Connection(int(argv[1]), readable=False)
    try:
        with contextlib.suppress(Exception):  # opening the store will say what failed
            prepare(None)
        serve(requests, answers)
    except (BrokenPipeError, EOFError):  # the job's process is gone mid-answer
        pass
    except Exception as err:  # the job goes on unrecorded, and is told why
        say(f"the MLflow recorder stopped: {first_line(driver_error(err))}")
    finally:
        sys.stdout.flush()
        os._exit(0)  # skip collecting what MLflow made: nothing is left to write


if __name__ == "__main__":
    main(sys.argv[1:])
