"""``kspipe +experiment=ctr_datafeed``: a click-through model trained from real MultiSlot
files by Paddle's reader threads, in one process and on a real loopback parameter-server
cluster, recorded in MLflow; its checkpoints in one process; and its bad inputs, each one
clear line.  (Its servers' tables, checkpointed and resumed: test_ctr_tables.py.)"""

import glob
import json
import os

import numpy as np
import pytest

from kspipe.ctr.evaluation import roc_auc
from kspipe.ctr.training import auc_from_histograms
from kspipe.datafeed import DataFeedDesc, python_batches
from kspipe.testing import assert_one_line_error, begun_store, run_kspipe, run_statuses
from tests.kit import CTR_LINES, CTR_MIN_AUC, ctr_overrides


def run_record(db):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "kspipe"]
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def exported_auc(model_dir, data_dir):
    """Test AUC of the exported inference model, loaded on its own."""
    import paddle

    paddle.enable_static()
    exe = paddle.static.Executor(paddle.CPUPlace())
    program, feeds, fetch = paddle.static.load_inference_model(f"{model_dir}/model", exe)
    desc = DataFeedDesc(f"{data_dir}/ctr.prototxt")
    labels, scores = [], []
    for feed in python_batches(sorted(glob.glob(f"{data_dir}/test/*")), desc, 500, {}):
        labels.append(np.array(feed["label"]).ravel())
        (pred,) = exe.run(program, feed={k: feed[k] for k in feeds}, fetch_list=fetch)
        scores.append(pred.ravel())
    return roc_auc(np.concatenate(labels), np.concatenate(scores))


@pytest.mark.parametrize("overrides", [[], ["datafeed.dataset=in_memory", "datafeed.threads=1"]])
def test_ctr_trains_from_files_in_one_process(tmp_path, overrides):
    result = run_kspipe(
        *ctr_overrides(
            tmp_path, "datafeed.fetch=[loss,tower_out.b]", "datafeed.print_period=20", *overrides
        ),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_auc"] >= CTR_MIN_AUC, metrics
    assert (
        metrics["test_instances"] == CTR_LINES and metrics["train_instances"] == 3 * 4 * CTR_LINES
    )
    assert metrics["samples_per_s"] > 0
    assert "test_auc" in result.stdout  # the summary line
    client, run = run_record(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_auc"] == pytest.approx(metrics["test_auc"])
    assert "samples_per_s" in run.data.metrics
    # the fetched variable and the running AUC were reported while training ran
    watched = client.get_metric_history(run.info.run_id, "fetch_tower_out.b")
    assert len(watched) >= 3 and len({m.value for m in watched}) > 1
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_auc")]
    assert steps[-1] == 3 * 4 * CTR_LINES and len(steps) >= 3
    data_dir = glob.glob(str(tmp_path / "cache" / "ctr-*"))[0]
    assert exported_auc(tmp_path / "run" / "inference_model", data_dir) == pytest.approx(
        metrics["test_auc"], abs=1e-6
    )


def test_ctr_trains_on_a_parameter_server_cluster(tmp_path):
    result = run_kspipe(
        *ctr_overrides(tmp_path, "mode=pserver", "workers=2", "cluster.timeout_s=300"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_auc"] >= CTR_MIN_AUC, metrics
    # each worker trained on its half of the files
    assert metrics["train_instances"] == 3 * 2 * CTR_LINES
    assert metrics["samples_per_s"] > metrics["worker_samples_per_s"]
    client, run = run_record(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
    logs = client.list_artifacts(run.info.run_id, "logs")
    assert len(logs) == 3  # a server and two workers
    server_log = next((tmp_path / "run" / "logs").glob("server*"))
    assert "ready" in server_log.read_text()
    # the export carries the tables pulled from the servers: it scores like the cluster did
    data_dir = glob.glob(str(tmp_path / "cache" / "ctr-*"))[0]
    assert exported_auc(tmp_path / "run" / "inference_model", data_dir) == pytest.approx(
        metrics["test_auc"], abs=1e-6
    )


DESC = """name: "MultiSlotDataFeed"
batch_size: 8
multi_slot_desc {
  slots { name: "label" type: "uint64" is_used: true }
  slots { name: "ids" type: "uint64" is_used: true }
  slots { name: "price" type: "float" is_dense: true is_used: true }
}
"""


@pytest.fixture
def own_files(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "desc.prototxt").write_text(DESC)
    rng = np.random.default_rng(0)
    for folder, files in (("train", 2), ("test", 1)):
        for f in range(files):
            lines = []
            for _ in range(40):
                ids = rng.integers(0, 50, rng.integers(1, 4))
                lines.append(
                    f"1 {int(ids[0] % 2)} {len(ids)} {' '.join(map(str, ids))} 1 {rng.normal():.3f}"
                )
            (tmp_path / folder / f"part-{f}").write_text("\n".join(lines) + "\n")
    return tmp_path


def own_args(tmp_path, *overrides):
    return [
        "+experiment=ctr_datafeed",
        f"run_dir={tmp_path / 'run'}",
        f"tracking.uri={begun_store(tmp_path)}",
        f"datafeed.desc={tmp_path / 'desc.prototxt'}",
        f"datafeed.train_files={tmp_path / 'train'}",
        f"datafeed.test_files={tmp_path / 'test'}",
        "ctr.epochs=1",
        *overrides,
    ]


def test_own_files_and_desc_train(own_files):
    result = run_kspipe(*own_args(own_files, "datafeed.threads=5"), cwd=own_files)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "datafeed.threads=5 but this worker has 2 file(s)" in result.stderr
    metrics = json.loads((own_files / "run" / "metrics.json").read_text())
    assert metrics["train_instances"] == 80 and metrics["test_instances"] == 40


def corrupt(path, line_number, text):
    lines = path.read_text().splitlines()
    lines[line_number - 1] = text
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("mode", ["local", "pserver"])
def test_a_malformed_line_is_named(own_files, mode):
    bad = own_files / "train" / "part-1"
    corrupt(bad, 7, "1 0 3 4 5 1 0.5")
    result = run_kspipe(
        *own_args(own_files, f"mode={mode}", "workers=2", "cluster.timeout_s=120"), cwd=own_files
    )
    assert_one_line_error(result, f"{bad}:7: the value count of slot 'price' is '0.5'")
    assert "FINISHED" not in run_statuses(own_files / "mlflow.db")


@pytest.mark.parametrize(
    "change, fragments",
    [
        (
            lambda d: corrupt(d / "train" / "part-0", 3, "1 1 2 4 abc 1 0.5"),
            ["part-0:3: slot 'ids' is uint64 but holds 'abc'"],
        ),
        (
            lambda d: corrupt(d / "test" / "part-0", 2, "1 1 1 4 1 0.5x"),
            ["test/part-0:2: slot 'price' is float but holds '0.5x'"],
        ),
        (
            lambda d: corrupt(d / "train" / "part-0", 1, "1 7 1 4 1 0.5"),
            ["part-0:1: label slot 'label' holds 7"],
        ),
        (
            lambda d: os.remove(d / "train" / "part-0") or os.remove(d / "train" / "part-1"),
            ["datafeed.train_files: folder", "has no files"],
        ),
        (
            lambda d: (d / "desc.prototxt").write_text(DESC.replace('"float"', '"double"')),
            ["has type 'double'"],
        ),
    ],
)
def test_bad_data_is_one_clear_line(own_files, change, fragments):
    change(own_files)
    result = run_kspipe(*own_args(own_files), cwd=own_files)
    assert_one_line_error(result, *fragments)
    assert "FINISHED" not in run_statuses(own_files / "mlflow.db")


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["datafeed.train_files=[/nowhere/part-0]"],
            ["datafeed.train_files: no such file: /nowhere/part-0"],
        ),
        (["datafeed.train_files=[]"], ["datafeed.train_files: the file list is empty"]),
        (["datafeed.desc=null"], ["datafeed.desc and datafeed.train_files go together"]),
        (["datafeed.label=click"], ["datafeed.label='click'", "slots: label, ids, price"]),
        (["datafeed.threads=0"], ["datafeed.threads=0 must be at least 1"]),
        (["datafeed.dataset=hdfs"], ["datafeed.dataset='hdfs'"]),
        (
            ["datafeed.fetch=[no_such_var]"],
            ["datafeed.fetch: the program has no variable 'no_such_var'"],
        ),
        (
            ["mode=collective"],
            ["mode=collective cannot run the ctr workload", "train_from_dataset's reader threads"],
        ),
        (["mode=pserver", "cluster.strategy=sync"], ["cluster.strategy=sync", "async"]),
        (["ctr.hash_size=0"], ["ctr.hash_size=0 must be at least 1"]),
        (["workers=3", "mode=pserver"], ["2 training file(s) for 3 workers"]),
    ],
)
def test_bad_ctr_config(own_files, overrides, fragments):
    result = run_kspipe(*own_args(own_files, "cluster.timeout_s=120", *overrides), cwd=own_files)
    assert_one_line_error(result, *fragments)
    assert "FINISHED" not in run_statuses(own_files / "mlflow.db")


def test_auc_from_the_auc_ops_histograms_matches_the_exact_auc():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 5000)
    scores = np.clip(0.5 + 0.2 * (labels - 0.5) + rng.normal(0, 0.2, 5000), 0, 1)
    buckets = np.minimum((scores * 4095).astype(int), 4095)
    pos = np.bincount(buckets[labels == 1], minlength=4096)
    neg = np.bincount(buckets[labels == 0], minlength=4096)
    assert auc_from_histograms(pos, neg) == pytest.approx(roc_auc(labels, scores), abs=2e-3)
    assert roc_auc([0, 1, 0, 1], [0.1, 0.9, 0.5, 0.5]) == pytest.approx(0.875)


def test_another_thread_count_in_the_same_process_is_refused_not_aborted(tmp_path):
    from kspipe.errors import ConfigError
    from kspipe.pipeline import run
    from kspipe.testing import compose_config, plugin_manager

    def cfg(threads, isolate):
        return compose_config(
            [
                "+experiment=ctr_datafeed",
                f"run_dir={tmp_path}/run{threads}",
                "tracking.enabled=false",
                "ctr.epochs=1",
                "datafeed.generated.lines_per_file=200",
                f"datafeed.generated.cache_dir={tmp_path}/cache",
                f"datafeed.threads={threads}",
                f"isolate={isolate}",
            ]
        )

    # a test process may have trained from files already: use a count it has not
    from kspipe.ctr import training

    used = training._process_threads or 2  # the default, which other in-process tests use
    other = 2 if used == 1 else 1
    assert run(cfg(used, False), plugin_manager())["train_instances"] == 1600
    with pytest.raises(ConfigError, match=f"already trained from files with {used} reader"):
        run(cfg(other, False), plugin_manager())
    # isolated, the same job runs in a process of its own and succeeds
    metrics = run(cfg(other, True), plugin_manager())
    assert (
        0 <= metrics["test_auc"] <= 1
        and (tmp_path / f"run{other}" / "logs" / "worker.0.log").exists()
    )


MIXED_DESC = """name: "MultiSlotDataFeed"
batch_size: 16
multi_slot_desc {
  slots { name: "label" type: "uint64" is_used: true }
  slots { name: "pair" type: "uint64" is_dense: true is_used: true }
  slots { name: "skip" type: "float" is_used: false }
  slots { name: "w" type: "float" is_used: true }
}
"""


def test_dense_id_slots_unused_slots_and_float_sequences(tmp_path):
    """A fixed-width id slot, a slot the reader must step over, a variable-length float slot."""
    (tmp_path / "desc.prototxt").write_text(MIXED_DESC)
    rng = np.random.default_rng(0)
    for folder, files in (("train", 2), ("test", 1)):
        (tmp_path / folder).mkdir()
        for f in range(files):
            lines = []
            for _ in range(300):
                a, b = rng.integers(0, 20, 2)
                w = rng.normal(size=rng.integers(1, 4))
                lines.append(
                    f"1 {int(a % 2)} 2 {a} {b} 2 0.5 9.5 {len(w)} "
                    + " ".join(f"{x:.3f}" for x in w)
                )
            (tmp_path / folder / f"part-{f}").write_text("\n".join(lines) + "\n")
    result = run_kspipe(*own_args(tmp_path, "ctr.epochs=3"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train_instances"] == 3 * 600
    assert metrics["test_auc"] > 0.9  # the label is the parity of the first id of "pair"
    import paddle

    paddle.enable_static()
    _, feeds, _ = paddle.static.load_inference_model(
        str(tmp_path / "run" / "inference_model" / "model"),
        paddle.static.Executor(paddle.CPUPlace()),
    )
    assert feeds == ["pair", "w"]  # no label, no unused slot


def test_checkpoints_each_epoch_and_resumes(tmp_path):
    first = tmp_path / "first"
    args = [*ctr_overrides(tmp_path), "ctr.epochs=1"]
    result = run_kspipe(
        *[a for a in args if not a.startswith("run_dir=")], f"run_dir={first}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in (first / "checkpoints").iterdir()] == ["checkpoint-0000001"]
    before = json.loads((first / "metrics.json").read_text())
    # nothing left to train: the restored weights score exactly as they did
    again = run_kspipe(
        *[a for a in args if not a.startswith("run_dir=")],
        f"run_dir={tmp_path / 'again'}",
        f"resume={first}",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after epoch 1" in again.stderr
    restored = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert restored["test_auc"] == before["test_auc"] and restored["train_instances"] == 0
    # one more epoch continues from there
    more = run_kspipe(
        *[a for a in args if not a.startswith("run_dir=")],
        "ctr.epochs=2",
        f"run_dir={tmp_path / 'more'}",
        f"resume={first}",
        cwd=tmp_path,
    )
    assert more.returncode == 0, more.stderr[-3000:]
    metrics = json.loads((tmp_path / "more" / "metrics.json").read_text())
    assert metrics["train_instances"] == 4 * CTR_LINES and metrics["test_auc"] >= CTR_MIN_AUC
    assert sorted(p.name for p in (tmp_path / "more" / "checkpoints").iterdir()) == [
        "checkpoint-0000002"
    ]
