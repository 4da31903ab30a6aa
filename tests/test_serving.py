"""Each run's inference model is an MLflow model that `mlflow models serve` answers with
what kspipe itself computes: click probabilities (ctr), and the classes of a few-shot
task's queries after adapting on its support set (Reptile)."""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from kspipe.endpoints import free_ports
from kspipe.testing import tiny_overrides


def kspipe(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kspipe.cli", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=600)


def only_run(store: str):
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    return client, run


class Server:
    """An MLflow command serving HTTP on a free port of 127.0.0.1, started in the
    background: ``ready()`` waits until it answers ``health``."""

    def __init__(self, args: list[str], health: str, cwd: Path, env: dict | None = None):
        (port,) = free_ports(1)
        self.url, self.health = f"http://127.0.0.1:{port}", health
        self.log = cwd / f"server-{port}.log"
        temporary = cwd / f"server-{port}-tmp"  # MLflow's lock files, kept out of /tmp
        temporary.mkdir()
        env = dict(env or os.environ, TMPDIR=str(temporary))
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlflow", *args, "--host", "127.0.0.1", "--port",
                 str(port)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)

    def ready(self, timeout: float = 180) -> str:
        """The server's URL, once it answers."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                urllib.request.urlopen(self.url + self.health, timeout=5).close()
                return self.url
            except OSError:
                assert time.monotonic() < deadline, f"{self.log}: the server did not start"
                time.sleep(0.5)

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@contextlib.contextmanager
def model_server(store: str, run_id: str, cwd: Path):
    """`mlflow models serve` of the run's model (started; stopped at the end of the block)."""
    server = Server(["models", "serve", "-m", f"runs:/{run_id}/model", "--env-manager",
                     "local"], "/ping", cwd, dict(os.environ, MLFLOW_TRACKING_URI=store))
    try:
        yield server
    finally:
        server.stop()


def invoke(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# --- ctr ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ctr_run(tmp_path_factory):
    """ctr trained on a parameter-server cluster (the launcher process logs the model of a
    job whose workers trained it), served."""
    tmp = tmp_path_factory.mktemp("ctr")
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    result = kspipe("+experiment=ctr_datafeed", "ctr.epochs=1", "mode=pserver", "workers=2",
                    "datafeed.generated.lines_per_file=500",
                    f"datafeed.generated.cache_dir={tmp / 'cache'}", f"run_dir={tmp / 'run'}",
                    f"tracking.uri={store}", "tracking.register=clicks", cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "was not logged" not in result.stderr, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    client, run = only_run(store)
    with model_server(store, run.info.run_id, tmp) as server:
        yield tmp, store, result, run, server.ready()


def test_a_run_names_the_runs_page_of_its_experiment(ctr_run):
    _, store, result, run, _ = ctr_run
    line = (f"kspipe: runs: mlflow ui --backend-store-uri {store} then "
            f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs"
            f"?orderByKey=metrics.%60test_auc%60&orderByAsc=false")
    assert line in result.stderr.splitlines()


def test_the_served_click_model_answers_kspipes_own_probabilities(ctr_run):
    import paddle

    from kspipe.ctr.evaluation import roc_auc
    from kspipe.datafeed.desc import DataFeedDesc
    from kspipe.datafeed.files import parse_line, python_batches

    tmp, _, _, run, url = ctr_run
    (folder,) = glob.glob(str(tmp / "cache" / "ctr-*"))
    desc = DataFeedDesc(os.path.join(folder, "ctr.prototxt"))
    files = sorted(glob.glob(os.path.join(folder, "test", "part-*")))
    slots = [s.name for s in desc.slots if s.name != "label"]
    rows, labels = [], []
    for path in files:
        for line in open(path):
            values = parse_line(line, desc.slots, {})
            labels.append(values[0][0])
            rows.append(values[1:])
    status, answer = invoke(url, {"dataframe_split": {"columns": slots, "data": rows}})
    assert status == 200, answer
    served = np.array([p["probability"] for p in answer["predictions"]])

    # kspipe's own batches of the same lines through the exported program
    paddle.enable_static()
    exe = paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(paddle.static.Scope()):
        program, feeds, fetches = paddle.static.load_inference_model(
            str(tmp / "run" / "inference_model" / "model"), exe)
        expected = np.concatenate([
            np.asarray(exe.run(program, feed={k: batch[k] for k in feeds},
                               fetch_list=fetches)[0]).reshape(-1)
            for batch in python_batches(files, desc, 64, {})])
    assert len(served) == len(expected) == 1000
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6)
    # and the run's own evaluation of these lines: its AUC and log loss
    p = np.clip(served, 1e-7, 1 - 1e-7)
    y = np.array(labels, np.float64)
    assert roc_auc(y, p) == pytest.approx(run.data.metrics["test_auc"], abs=1e-6)
    logloss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert logloss == pytest.approx(run.data.metrics["test_logloss"], abs=1e-6)


def test_a_request_with_wrong_columns_is_a_clear_400(ctr_run):
    *_, url = ctr_run
    status, answer = invoke(url, {"dataframe_split": {
        "columns": ["dense", "usr", "item", "tags"], "data": [[[0.1] * 4, [5], [7], [1, 2]]]}})
    assert status == 400
    assert "missing inputs ['user']" in answer["message"]
    status, answer = invoke(url, {"dataframe_split": {
        "columns": ["dense", "user", "item", "tags"], "data": [[[0.1] * 3, [5], [7], [1]]]}})
    assert status == 400
    assert answer["message"].endswith("row 0, slot 'dense' has 3 values; the dense slot takes 4")
    assert "Traceback" not in json.dumps(answer)


def test_the_model_has_a_signature_and_is_registered(ctr_run, monkeypatch):
    import mlflow

    _, store, _, run, _ = ctr_run
    client = MlflowClient(tracking_uri=store)
    (version,) = client.search_model_versions("name = 'clicks'")
    assert version.run_id == run.info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # where runs:/ is looked up
    info = mlflow.models.get_model_info(f"runs:/{run.info.run_id}/model")
    assert [c["name"] for c in info.signature.inputs.to_dict()] == ["dense", "user", "item", "tags"]
    assert [c["name"] for c in info.signature.outputs.to_dict()] == ["probability"]
    assert info.saved_input_example_info is not None


def test_a_name_the_registry_refuses_is_one_line_before_any_run(ctr_run, tiny_data):
    from kspipe.errors import ConfigError
    from kspipe.pipeline import run
    from kspipe.testing import compose_config

    tmp, store, *_ = ctr_run
    common = ["+experiment=omniglot_5way", *tiny_overrides(tmp / "refused", tiny_data),
              f"tracking.uri={store}"]
    with pytest.raises(ConfigError) as refused:
        run(compose_config([*common, "tracking.model=true", "tracking.register=team/fewshot"]))
    assert str(refused.value) == (
        "tracking.register=team/fewshot: the MLflow model registry refuses it: "
        "Invalid model name 'team/fewshot'. Names cannot contain '/' or ':'.")
    with pytest.raises(ConfigError) as refused:
        run(compose_config([*common, "tracking.model=false", "tracking.register=fewshot"]))
    assert str(refused.value) == ("tracking.register=fewshot registers the run's MLflow model, "
                                  "which tracking.model=false does not log")
    only_run(store)  # the ctr run alone: none was started, so none is left RUNNING


# --- Reptile: kspipe's own adaptation (tests/test_search.py serves the best trial) ----


def a_test_task(run_dir: Path):
    """A test task of the run's data set (two queries per class), and the run's config."""
    from kspipe.fewshot import plugin as open_ks
    from kspipe.fewshot.data import sample_task
    from kspipe.modes.role import Role

    cfg = OmegaConf.load(run_dir / "inference_model" / "kspipe_config.yaml")
    dataset = open_ks.kspipe_read_dataset(cfg=cfg, role=Role())
    task = sample_task(dataset.test, cfg.task.ways, cfg.task.shots, 2, np.random.default_rng(7))
    return task, dataset, cfg


def reference_adaptation(run_dir: Path, task, dataset, seed: int):
    """kspipe's own adaptation of ``task``, as its evaluation of the run's final model
    (`evaluate=<run>`) does it: the logits of the queries."""
    import paddle

    from kspipe.modes.role import Role
    from kspipe.reptile import plugin as reptile
    from kspipe.reptile.learner import ReptileLearner
    from kspipe.reptile.tasks import nchw

    paddle.enable_static()
    cfg = OmegaConf.load(run_dir / "inference_model" / "kspipe_config.yaml")
    programs = reptile.kspipe_build_program(cfg=cfg, dataset=dataset, role=Role())
    programs = reptile.kspipe_compile_program(cfg=cfg, role=Role(), programs=programs)
    learner = ReptileLearner(cfg, dataset, programs, paddle.static.Executor(paddle.CPUPlace()),
                             paddle.static.Scope(), None)
    learner.initialize()
    learner.load_checkpoint(str(run_dir), "evaluate")
    learner.adapt(nchw(task.support_x), task.support_y, cfg.eval.inner_batch,
                  cfg.eval.inner_iters, np.random.default_rng(seed))
    return learner.query_logits(nchw(task.support_x), nchw(task.query_x))
