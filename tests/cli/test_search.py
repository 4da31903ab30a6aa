"""A hyperparameter search (hydra-optuna-sweeper): trials as child runs of one parent that
names the best, each with the data it trained on and its system metrics; a trial that
fails is a FAILED child run and the search goes on (or ends, in one line, past
``hydra.sweeper.max_failure_rate``); the best trial's model served as few-shot
inference; the MLflow UI, in a real headless browser, shows the search's runs, their
data set and a run's system metrics."""

import json

import numpy as np
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from kspipe.files import files_digest
from kspipe.testing import (
    Server,
    invoke,
    model_server,
    run_kspipe,
    run_statuses,
    tiny_overrides,
)
from tests.kit import a_test_task, chromium_missing, page_text, reference_adaptation

SEARCH = [
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_trials=3",
    "hydra.sweeper.sampler.seed=1",
    "train.inner_lr=interval(0.0001,0.01)",
]


def tiny(tmp, data):
    """A tiny Reptile job; jobs share the sweep's process (Reptile leaves nothing behind)."""
    return [
        "+experiment=omniglot_5way",
        "isolate=false",
        "eval.baseline=false",
        "eval.interval=0",
        *[
            o
            for o in tiny_overrides(tmp, data)
            if not o.startswith(("run_dir=", "eval.interval=", "tracking.model="))
        ],
    ]


@pytest.fixture(scope="module")
def search(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("search")
    result = run_kspipe("-m", *tiny(tmp, tiny_data), *SEARCH, cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("kspipe").experiment_id],
        order_by=["attributes.start_time ASC"],
    )
    (parent,) = [r for r in runs if r.data.tags.get("kspipe.sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return tmp, result, client, parent, children


@pytest.fixture(scope="module")
def ui(search):
    """`mlflow server` on the search's store, started in the background as soon as the
    search is done (the tests before the browser's run meanwhile); none without chromium."""
    if chromium_missing() is not None:
        yield None
        return
    tmp = search[0]
    server = Server(
        ["server", "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--workers", "1"],
        "/health",
        tmp,
    )
    try:
        yield server
    finally:
        server.stop()


def test_each_trial_is_a_child_run_and_the_parent_names_the_best(search, ui):
    tmp, result, client, parent, children = search
    assert len(children) == 3 and parent.info.status == "FINISHED"
    assert all(c.info.status == "FINISHED" for c in children)
    rates = [float(c.data.params["train.inner_lr"]) for c in children]
    assert len(set(rates)) == 3 and all(0.0001 <= r <= 0.01 for r in rates)
    assert sorted(c.info.run_name for c in children) == sorted(
        f"train.inner_lr={c.data.params['train.inner_lr']}" for c in children
    )
    best = max(children, key=lambda c: c.data.metrics["test_accuracy"])  # first of ties
    assert parent.data.tags["kspipe.best_run"] == best.info.run_id
    best_lr = best.data.params["train.inner_lr"]
    assert parent.data.tags["kspipe.best_job"] == f"train.inner_lr={best_lr}"
    assert (
        f"kspipe: best: train.inner_lr={best.data.params['train.inner_lr']}: test_accuracy "
        f"{best.data.metrics['test_accuracy']:.3f} (run {best.info.run_id})"
    ) in result.stderr
    table = open(client.download_artifacts(parent.info.run_id, "comparison.csv", str(tmp))).read()
    assert len(table.splitlines()) == 4 and "test_accuracy" in table.splitlines()[0]
    page = (
        f"kspipe: runs: mlflow ui --backend-store-uri sqlite:///{tmp / 'mlflow.db'} then "
        f"http://127.0.0.1:5000/#/experiments/{parent.info.experiment_id}/runs"
        f"?orderByKey=metrics.%60test_accuracy%60&orderByAsc=false"
    )
    assert result.stderr.splitlines().count(page) == 1  # once, at the end of the sweep
    assert "A new study created" not in result.stderr  # optuna's info line, not the job's
    (results,) = (tmp / "multirun").glob("*/*/optimization_results.yaml")
    assert OmegaConf.load(results).best_value == max(  # optuna maximised the headline
        c.data.metrics["test_accuracy"] for c in children
    )


def test_each_trial_records_the_data_it_trained_on_and_its_system_metrics(search, tiny_data):
    """Three runs on the same files show one digest, the images' they read; each run's
    process logs its CPU, memory and network (a run of one process: no node id)."""
    _, _, _, _, children = search
    images = sorted(str(p) for p in tiny_data.glob("images_*/*/*/*.png"))
    assert len(images) == 30 * 6
    for child in children:
        (data,) = child.inputs.dataset_inputs
        assert (data.dataset.name, data.dataset.digest) == (tiny_data.name, files_digest(images))
        assert json.loads(data.dataset.source) == {"uri": str(tiny_data)}
        assert json.loads(data.dataset.profile) == {"classes": 30, "images": 180}
        assert {t.key: t.value for t in data.tags} == {"mlflow.data.context": "training"}
        metrics = child.data.metrics
        assert 0 < metrics["system/cpu_utilization_percentage"] <= 100
        assert metrics["system/process_memory_usage_megabytes"] > 100  # Paddle's process
        assert metrics["system/network_receive_megabytes"] >= 0
        assert 0 < metrics["system/system_memory_usage_percentage"] <= 100


#: A meta step this large sends the weights to infinity: the trial's training goes NaN (a
#: failure at run time, which no check of the config can see), and the trial fails.
DIVERGES = "train.meta_step=1e+38"
#: Its parameters go non-finite by the first checkpoint, which refuses them
NAN = (
    "parameter conv0.w holds nan (element [0, 0, 0, 0]; 144 of its 144 values are not "
    "finite) at the checkpoint of step 2 (not written)"
)


def search_runs(tmp) -> tuple:
    """The search's parent run in ``tmp``'s store and its children, first started first."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("kspipe").experiment_id],
        order_by=["attributes.start_time ASC"],
    )
    (parent,) = [r for r in runs if r.data.tags.get("kspipe.sweep") == "parent"]
    return parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


def test_a_failed_trial_is_a_failed_child_run_and_the_search_goes_on(tmp_path, tiny_data):
    """Each meta step of the grid once: the diverging one fails in one line and is recorded
    FAILED (by the sweeper too, not as a value); the search goes on, its parent FINISHED
    names the best trial, and the command says which trials failed."""
    result = run_kspipe(
        "-m",
        *tiny(tmp_path, tiny_data),
        "hydra/sweeper=optuna",
        # optuna 2.10's grid sampler ends a study once its grid is done by Study.stop, which
        # raises outside optimize (the sweeper asks and tells); a seeded random sampler that
        # draws each value once stands for it
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.n_trials=2",
        "train.meta_step=choice(0.5,1e38)",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    parent, children = search_runs(tmp_path)
    by_step = {c.data.params["train.meta_step"]: c for c in children}
    assert sorted(by_step) == ["0.5", "1e+38"]
    done, failed = by_step["0.5"], by_step["1e+38"]
    assert (done.info.status, failed.info.status) == ("FINISHED", "FAILED")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["kspipe.best_job"] == "train.meta_step=0.5"
    assert parent.data.tags["kspipe.best_run"] == done.info.run_id
    errors = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error:")]
    assert errors == [f"kspipe: error: job {DIVERGES}: {NAN}"]
    assert f"[HYDRA] Failed experiment: {DIVERGES}: {NAN}" in result.stdout  # optuna's FAIL
    assert result.stderr.splitlines()[-1] == (
        f"kspipe: 1 trial(s) of the search failed, recorded FAILED "
        f"(hydra.sweeper.max_failure_rate=1.0): {DIVERGES}: {NAN}"
    )
    (results,) = (tmp_path / "multirun").glob("*/*/optimization_results.yaml")
    assert OmegaConf.to_container(OmegaConf.load(results)) == {
        "name": "optuna",
        "best_params": {"train.meta_step": 0.5},
        "best_value": done.data.metrics["test_accuracy"],
    }


def test_past_max_failure_rate_the_search_ends_in_one_line(tmp_path, tiny_data):
    """``hydra.sweeper.max_failure_rate=0``: the first failed trial ends the search, said in
    one line after the trial's own; the trial and the parent are FAILED."""
    result = run_kspipe(
        "-m",
        *tiny(tmp_path, tiny_data),
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.max_failure_rate=0",
        "train.meta_step=choice(1e38)",
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error:")]
    assert errors == [  # the trial's line as it fails, then the search's end
        f"kspipe: error: job {DIVERGES}: {NAN}",
        "kspipe: error: the search ended: more than hydra.sweeper.max_failure_rate=0.0 of a "
        f"batch of hydra.sweeper.n_jobs=2 trials failed: {DIVERGES}: {NAN}; the search's "
        "parent run is recorded as FAILED",
    ]
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED", "FAILED"]


@pytest.mark.parametrize("rate", ["1.5", "-0.1", "many"])
def test_a_max_failure_rate_out_of_0_to_1_is_one_line(rate):
    from kspipe.cli.arguments import check_search
    from kspipe.errors import ConfigError

    search = ["-m", "hydra/sweeper=optuna", "train.inner_lr=interval(0.0001,0.01)"]
    check_search(search)
    check_search([*search, "hydra.sweeper.max_failure_rate=0.5"])
    with pytest.raises(ConfigError) as refused:
        check_search([*search, f"hydra.sweeper.max_failure_rate={rate}"])
    assert str(refused.value) == (
        f"hydra.sweeper.max_failure_rate={rate}: the share of a batch of trials that may fail "
        f"is a number from 0 to 1"
    )


@pytest.mark.parametrize(
    "space, message",
    [
        (
            "hydra/sweeper=nope",
            "kspipe: error: hydra/sweeper=nope: no such option of hydra/sweeper "
            "(available: basic, optuna)",
        ),
        (
            "train.inner_lr=interval(0.1)",
            "kspipe: error: train.inner_lr=interval(0.1): cannot read "
            "it (Error parsing override 'train.inner_lr=interval(0.1)')",
        ),
    ],
)
def test_an_unknown_sweeper_or_a_search_space_that_does_not_parse_is_one_line(
    tmp_path, tiny_data, space, message
):
    """What `kspipe -m ... hydra/sweeper=optuna <space>` checks before Hydra starts."""
    from kspipe.cli.checks import check_config
    from kspipe.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        check_config(["-m", *tiny(tmp_path, tiny_data), "hydra/sweeper=optuna", space], [])
    assert f"kspipe: error: {refused.value}" == message


def test_the_best_trials_model_serves_few_shot_inference(search):
    """The served model adapts on the request's support set exactly as kspipe's own
    evaluation adapts a test task (same state, same steps), then classifies the queries."""
    tmp, _, client, parent, _ = search
    best = client.get_run(parent.data.tags["kspipe.best_run"])
    run_dir = tmp / best.data.params["run_dir"]  # an absolute run_dir stays as it is
    task, dataset, cfg = a_test_task(run_dir)
    images = np.concatenate([task.support_x, task.query_x])
    labels = [*task.support_y.tolist(), *[-1] * len(task.query_y)]
    body = {
        "dataframe_split": {
            "columns": ["image", "label"],
            "data": [[im.reshape(-1).tolist(), lab] for im, lab in zip(images, labels)],
        },
        "params": {"seed": 3},
    }
    with model_server(f"sqlite:///{tmp / 'mlflow.db'}", best.info.run_id, tmp) as server:
        logits = reference_adaptation(run_dir, task, dataset, seed=3)  # while it starts
        url = server.ready()
        status, answer = invoke(url, body)
        assert status == 200, answer
        assert invoke(url, body) == (status, answer)  # each request starts from the model
        bad_status, bad = invoke(
            url, {"dataframe_split": {"columns": ["image", "label"], "data": [[[0.5] * 784, 0]]}}
        )
    odds = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected = odds / odds.sum(axis=1, keepdims=True)
    served = np.array([p["probabilities"] for p in answer["predictions"]])
    assert served.shape == (len(task.query_y), cfg.task.ways)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6)
    assert [p["class"] for p in answer["predictions"]] == expected.argmax(axis=1).tolist()
    assert bad_status == 400 and bad["message"].endswith(
        "a task needs support images (label 0..ways-1) and at least one query (label -1)"
    )


@pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))
def test_the_runs_page_shows_the_search_in_a_headless_browser(search, ui):
    tmp, result, _, parent, children = search
    (line,) = [s for s in result.stderr.splitlines() if s.startswith("kspipe: runs: ")]
    page = line.rsplit(" then ", 1)[1]
    names = [
        parent.info.run_name.split(" tracking.uri=")[0],  # a long name is cut short
        *(c.info.run_name for c in children),
    ]
    text = page_text(page.replace("http://127.0.0.1:5000", ui.ready()), names, tmp / "chromium")
    assert text.startswith(f"Runs - Experiment {parent.info.experiment_id} - MLflow")
    for name in names:  # sorted by the headline, the trials are not folded under the parent
        assert name in text, name
    (data,) = children[0].inputs.dataset_inputs  # the dataset column
    assert text.count(f"{data.dataset.name} ({data.dataset.digest})") == len(children)
    run = f"{page.split('?')[0].split('/#/')[1]}/{children[0].info.run_id}/system-metrics"
    charts = ["System metrics", "cpu_utilization_percentage", "network_receive_megabytes"]
    text = page_text(f"{ui.ready()}/#/{run}", charts, tmp / "chromium")
    for chart in charts:
        assert chart in text, chart
