"""A run's inference model as an MLflow model (a pyfunc), and its registration.

MLflow's ``paddle`` flavour cannot serve kspipe's models: it saves and loads dygraph
layers (``paddle.jit.save`` / ``paddle.jit.load``, or a ``paddle.Model``), while kspipe
exports static-graph inference programs (``paddle.static.save_inference_model``), and
Reptile's service must also adapt the model on each request's support set, which no
flavour's ``predict`` does.  So the model is a pyfunc: :class:`KspipeModel` wraps the
predictor the workload names (:attr:`kspipe.contracts.Workload.serving`), with the run's
``inference_model/`` folder (and whatever else the predictor asks for) as artifacts.

A predictor is a class built from ``{name: local path}`` of those artifacts, with
``predict(frame, params)`` (a table in, a table out; a :class:`~kspipe.errors.KspipeError`
for a request it cannot answer, which the server returns as a 400 with its message) and
two static methods: ``artifacts(run_dir)`` (what to carry of a run folder) and
``example(artifacts)``, read without building the model: ``input`` (a request's table,
the input example), ``output`` (an answer's), ``params`` (the request parameters, with
their defaults) and optionally ``unchecked`` (columns of lists that MLflow must pass on as
given, such as uint64 ids beyond its ``long``).  MLflow builds the model once while
logging it, to check that the example is served.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
import warnings

import pandas as pd

import mlflow
from kspipe.errors import ConfigError, KspipeError, first_line
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

MODEL_NAME = "model"  # runs:/<run id>/model


class KspipeModel(mlflow.pyfunc.PythonModel):
    """The pyfunc of a kspipe run: ``predict`` is the workload's predictor's.

    :param serving: ``module:Class`` of the predictor.
    """

    def __init__(self, serving: str):
        self.serving = serving
        self.predictor = None

    def load_context(self, context) -> None:
        self.predictor = predictor_class(self.serving)(dict(context.artifacts))

    # a frame's hint: MLflow infers nothing from it (the signature comes from the
    # predictor's example) and no longer warns that ``predict`` has no hints
    def predict(self, context, model_input: pd.DataFrame, params=None):
        try:
            return self.predictor.predict(model_input, dict(params or {}))
        except KspipeError as err:  # the request's mistake: a 400 with one line
            raise MlflowException(str(err), error_code=INVALID_PARAMETER_VALUE) from None


def predictor_class(serving: str):
    module, _, name = serving.partition(":")
    return getattr(importlib.import_module(module), name)


def log_model(
    uri: str,
    run_id: str,
    run_dir: str,
    serving: str,
    register: str | None = None,
    alias: str | None = None,
    metrics: dict | None = None,
    step: int = 0,
) -> str:
    """Log the run folder's inference model as the pyfunc ``model`` of ``run_id``, with a
    signature and an input example, and its ``metrics`` (the run's final ones, logged at
    ``step``: MLflow 3's model view ranks models by them), and register it as ``register``
    if set, that version then ``models:/<register>@<alias>`` with ``alias``; return the
    model's URI.  A name the registry refuses raises :class:`ConfigError`.

    Logged in an active run, MLflow would give the model every metric the run logged at
    its step (a Reptile run's baseline, at 0): the model is made for the run outside it,
    and given its run and its metrics here."""
    from mlflow.entities import LoggedModelOutput, Metric
    from mlflow.models import infer_signature

    cls = predictor_class(serving)
    artifacts = cls.artifacts(run_dir)
    with static_graph():
        example = cls.example(artifacts)
        with quiet():
            signature = infer_signature(
                example["input"], example["output"], params=example["params"] or None
            )
        signature.inputs = loosened(signature.inputs, example.get("unchecked", ()))
        with quiet(), fluent_store(uri):
            client = mlflow.MlflowClient(uri)
            run = client.get_run(run_id)
            model = mlflow.initialize_logged_model(
                name=MODEL_NAME,
                source_run_id=run_id,
                params=run.data.params,
                experiment_id=run.info.experiment_id,
            )
            info = mlflow.pyfunc.log_model(
                name=MODEL_NAME,
                model_id=model.model_id,
                python_model=KspipeModel(serving),
                artifacts=artifacts,
                signature=signature,
                input_example=example["input"],
                pip_requirements=requirements(),
            )
            client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
            now = int(time.time() * 1000)
            scores = [
                Metric(name, float(value), now, step, model_id=model.model_id, run_id=run_id)
                for name, value in (metrics or {}).items()
            ]
            if scores:
                client.log_batch(run_id, metrics=scores)
    if register:
        try:
            with fluent_store(uri):
                version = mlflow.register_model(info.model_uri, register)
            if alias:  # the alias moves to this version from any other
                mlflow.MlflowClient(uri).set_registered_model_alias(
                    register, alias, version.version
                )
        except MlflowException as err:
            raise registry_error(register, err) from err
    return f"runs:/{run_id}/{MODEL_NAME}"


def download_model(model_uri: str, uri: str, folder: str) -> str:
    """The ``inference_model`` folder of the MLflow model ``model_uri`` (``models:/<id>``,
    ``models:/<name>/<version>``, ``runs:/<run id>/model``) of the store ``uri``, downloaded
    into ``folder``."""
    try:
        with quiet(), fluent_store(uri):
            local = mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=folder)
    except MlflowException as err:
        raise ConfigError(f"{model_uri}: no such model in {uri}: {first_line(err)}") from None
    found = os.path.join(local, "artifacts", "inference_model")
    if not os.path.isdir(found):
        raise ConfigError(f"{model_uri}: not a kspipe model (it has no inference_model)")
    return found


def log_model_folder(uri: str, run_id: str, model_dir: str, serving: str, step: int, **more):
    """:func:`log_model` of the exported model ``model_dir`` (any folder, not only a run's
    ``inference_model``) as a new model of the run ``run_id``, at ``step``."""
    import shutil
    import tempfile

    def link(source, target):  # the files linked, not copied (MLflow copies them)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(model_dir))) as run_dir:
        shutil.copytree(model_dir, os.path.join(run_dir, "inference_model"), copy_function=link)
        return log_model(uri, run_id, run_dir, serving, step=step, **more)


@contextlib.contextmanager
def static_graph():
    """Paddle in static-graph mode for the block, as the exported programs need it.  A
    launcher process never entered it (its workers did): without this, a cluster run's
    model was never logged."""
    import paddle

    dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        yield
    finally:
        if dynamic:
            paddle.disable_static()


@contextlib.contextmanager
def fluent_store(uri: str):
    """MLflow's fluent API on the store ``uri`` for the block.  MLflow keeps the setting in
    the process and in ``MLFLOW_TRACKING_URI`` (which processes started later inherit);
    both are as they were afterwards."""
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)
        if previous is not None:
            os.environ["MLFLOW_TRACKING_URI"] = previous


def loosened(schema, names):
    """``schema`` with the columns ``names`` taking lists of any values, which MLflow then
    passes on as given (uint64 ids beyond its ``long``); the predictor checks them."""
    from mlflow.types.schema import AnyType, Array, ColSpec, Schema

    return Schema(
        [
            ColSpec(Array(AnyType()), column.name) if column.name in names else column
            for column in schema.inputs
        ]
    )


@contextlib.contextmanager
def quiet():
    """No progress bars, hints or pickling notes from MLflow while it logs the model: the
    model is pickled by reference to its class (kspipe is installed where it is served),
    and its signature comes from the predictor's own example."""
    logger = logging.getLogger("mlflow.pyfunc")
    level = logger.level
    logger.setLevel(logging.ERROR)
    bar = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            # pandas 3's note on MLflow's own code reading the example's columns
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        logger.setLevel(level)
        if bar is None:
            del os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"]
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = bar


def requirements() -> list[str]:
    """What the model's own environment needs: kspipe itself brings the rest."""
    from importlib.metadata import version

    return [f"kspipe=={version('kspipe')}"]


def check_registry_name(client, name: str, alias: str | None = None) -> None:
    """Raise :class:`ConfigError` now, before a run starts, for a name (or an alias) the
    registry refuses."""
    from mlflow.utils.validation import (
        _validate_model_alias_name,
        _validate_model_alias_name_reserved,
    )

    try:
        client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise registry_error(name, err) from err
    if alias:
        try:
            _validate_model_alias_name(alias)
            _validate_model_alias_name_reserved(alias)
        except MlflowException as err:
            raise ConfigError(
                f"tracking.alias={alias}: the MLflow model registry refuses it: {first_line(err)}"
            ) from err


def registry_error(name: str, err: MlflowException) -> ConfigError:
    return ConfigError(
        f"tracking.register={name}: the MLflow model registry refuses it: {first_line(err)}"
    )
