"""Each run's inference model is an MLflow model that `mlflow models serve` answers with
what kspipe itself computes: here click probabilities (ctr), served by the alias of its
registered version.  (The classes of a few-shot task's queries after adapting on its
support set, Reptile: cli/test_search.py serves a search's best trial.)  The same cluster
run holds each process's system metrics and the files it trained on, which the MLflow UI
shows."""

import glob
import hashlib
import json
import os

import numpy as np
import pytest
from mlflow import MlflowClient

from kspipe.testing import Server, begun_store, invoke, model_server, run_kspipe, tiny_overrides
from tests.kit import chromium_missing, page_text


def only_run(store: str):
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    return client, run


# --- ctr ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ctr_run(tmp_path_factory):
    """ctr trained on a parameter-server cluster (the launcher process logs the model of a
    job whose workers trained it), served as ``models:/clicks@champion``."""
    tmp = tmp_path_factory.mktemp("ctr")
    store = begun_store(tmp)
    result = run_kspipe(
        "+experiment=ctr_datafeed",
        "ctr.epochs=1",
        "mode=pserver",
        "workers=2",
        "datafeed.generated.lines_per_file=500",
        f"datafeed.generated.cache_dir={tmp / 'cache'}",
        f"run_dir={tmp / 'run'}",
        f"tracking.uri={store}",
        "tracking.register=clicks",
        "tracking.alias=champion",
        "tracking.system_metrics_interval=2",
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "was not logged" not in result.stderr, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    client, run = only_run(store)
    with model_server(store, "models:/clicks@champion", tmp) as server:
        yield tmp, store, result, run, server.ready()


@pytest.fixture(scope="module")
def ui(ctr_run):
    """`mlflow server` on the run's store, started in the background as soon as the run is
    done (the tests before the browser's run meanwhile); none without chromium."""
    if chromium_missing() is not None:
        yield None
        return
    tmp, store, *_ = ctr_run
    server = Server(["server", "--backend-store-uri", store, "--workers", "1"], "/health", tmp)
    try:
        yield server
    finally:
        server.stop()


def test_a_run_names_the_runs_page_of_its_experiment(ctr_run, ui):
    _, store, result, run, _ = ctr_run
    line = (
        f"kspipe: runs: mlflow ui --backend-store-uri {store} then "
        f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs"
        f"?orderByKey=metrics.%60test_auc%60&orderByAsc=false"
    )
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
            str(tmp / "run" / "inference_model" / "model"), exe
        )
        expected = np.concatenate(
            [
                np.asarray(
                    exe.run(program, feed={k: batch[k] for k in feeds}, fetch_list=fetches)[0]
                ).reshape(-1)
                for batch in python_batches(files, desc, 64, {})
            ]
        )
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
    status, answer = invoke(
        url,
        {
            "dataframe_split": {
                "columns": ["dense", "usr", "item", "tags"],
                "data": [[[0.1] * 4, [5], [7], [1, 2]]],
            }
        },
    )
    assert status == 400
    assert "missing inputs ['user']" in answer["message"]
    status, answer = invoke(
        url,
        {
            "dataframe_split": {
                "columns": ["dense", "user", "item", "tags"],
                "data": [[[0.1] * 3, [5], [7], [1]]],
            }
        },
    )
    assert status == 400
    assert answer["message"].endswith("row 0, slot 'dense' has 3 values; the dense slot takes 4")
    assert "Traceback" not in json.dumps(answer)


def test_the_model_has_a_signature_and_is_registered(ctr_run, monkeypatch, tmp_path):
    import tempfile

    import mlflow

    _, store, _, run, _ = ctr_run
    client = MlflowClient(tracking_uri=store)
    (version,) = client.search_model_versions("name = 'clicks'")
    assert version.run_id == run.info.run_id
    assert client.get_model_version_by_alias("clicks", "champion").version == version.version
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # where runs:/ is looked up
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # MLflow leaves its copy there
    info = mlflow.models.get_model_info(f"runs:/{run.info.run_id}/model")
    assert [c["name"] for c in info.signature.inputs.to_dict()] == ["dense", "user", "item", "tags"]
    assert [c["name"] for c in info.signature.outputs.to_dict()] == ["probability"]
    assert info.saved_input_example_info is not None


def test_a_name_the_registry_refuses_is_one_line_before_any_run(ctr_run, tiny_data):
    from kspipe.errors import ConfigError
    from kspipe.pipeline import run
    from kspipe.testing import compose_config

    tmp, store, *_ = ctr_run
    common = [
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp / "refused", tiny_data),
        f"tracking.uri={store}",
    ]
    with pytest.raises(ConfigError) as refused:
        run(compose_config([*common, "tracking.model=true", "tracking.register=team/fewshot"]))
    assert str(refused.value) == (
        "tracking.register=team/fewshot: the MLflow model registry refuses it: "
        "Invalid model name 'team/fewshot'. Names cannot contain '/' or ':'."
    )
    with pytest.raises(ConfigError) as refused:
        run(compose_config([*common, "tracking.model=false", "tracking.register=fewshot"]))
    assert str(refused.value) == (
        "tracking.register=fewshot registers the run's MLflow model, "
        "which tracking.model=false does not log"
    )
    with pytest.raises(ConfigError) as refused:
        run(compose_config([*common, "tracking.model=true", "tracking.alias=champion"]))
    assert str(refused.value) == (
        "tracking.alias=champion names the model version tracking.register registers: "
        "set tracking.register=<name> too"
    )
    registered = ["tracking.model=true", "tracking.register=fewshot", "tracking.alias=latest"]
    with pytest.raises(ConfigError) as refused:
        run(compose_config([*common, *registered]))
    assert str(refused.value) == (
        "tracking.alias=latest: the MLflow model registry refuses it: "
        "'latest' alias name (case insensitive) is reserved."
    )
    only_run(store)  # the ctr run alone: none was started, so none is left RUNNING


# --- what the run ran on ----------------------------------------------------------------

NODES = ("worker0", "worker1", "server0")


def test_each_process_logs_its_system_metrics_under_its_node_id(ctr_run):
    """Each worker and the server sample their own process (CPU since it started, so above
    0; Paddle's resident memory) and their host's memory and network."""
    run = ctr_run[3]
    metrics = run.data.metrics
    assert {k.split("/")[1] for k in metrics if k.startswith("system/")} == set(NODES)
    for node in NODES:
        assert 0 < metrics[f"system/{node}/cpu_utilization_percentage"] <= 100
        assert metrics[f"system/{node}/process_memory_usage_megabytes"] > 100
        assert 0 < metrics[f"system/{node}/system_memory_usage_percentage"] <= 100
        assert metrics[f"system/{node}/network_receive_megabytes"] >= 0
        assert metrics[f"system/{node}/network_transmit_megabytes"] >= 0


def test_the_run_records_the_files_it_trained_on(ctr_run):
    """The desc, every worker's training files and the test files: their digest (of names
    and contents) is the input the runs table shows."""
    tmp, _, _, run, _ = ctr_run
    (folder,) = glob.glob(str(tmp / "cache" / "ctr-*"))
    files = [os.path.join(folder, "ctr.prototxt")]
    files += glob.glob(os.path.join(folder, "train", "part-*"))
    files += glob.glob(os.path.join(folder, "test", "part-*"))
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(os.path.relpath(path, folder).encode() + b"\0")
        digest.update(hashlib.sha256(open(path, "rb").read()).digest())
    (data,) = run.inputs.dataset_inputs
    assert (data.dataset.name, data.dataset.digest) == ("ctr-generated", digest.hexdigest()[:8])
    assert json.loads(data.dataset.source) == {"uri": folder}
    assert json.loads(data.dataset.profile) == {"train_files": 8, "test_files": 2}


@pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))
def test_the_ui_shows_the_runs_data_set_and_each_processs_system_metrics(ctr_run, ui):
    tmp, _, _, run, _ = ctr_run
    runs = f"{ui.ready()}/#/experiments/{run.info.experiment_id}/runs"
    (data,) = run.inputs.dataset_inputs
    shown = f"{data.dataset.name} ({data.dataset.digest})"
    assert shown in page_text(runs, [shown], tmp / "chromium")
    sections = [f"system/{node}" for node in NODES]
    text = page_text(f"{runs}/{run.info.run_id}/system-metrics", sections, tmp / "chromium")
    for section in sections:
        assert section in text, section
