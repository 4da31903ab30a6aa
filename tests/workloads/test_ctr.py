"""``kspipe +experiment=ctr_datafeed``: a click-through model trained from real MultiSlot
files by Paddle's reader threads, in one process and on a real loopback parameter-server
cluster, recorded in MLflow; and its bad inputs, each one clear line."""

import glob
import json
import math
import pickle
import os
import re
import shutil

import numpy as np
import pytest

from kspipe.ctr.evaluation import roc_auc
from kspipe.ctr.training import auc_from_histograms
from kspipe.datafeed import DataFeedDesc, python_batches
from kspipe.testing import assert_one_line_error, job_processes, run_kspipe, run_statuses

#: The test AUC a trained ctr model must reach: the generated set's dense features alone
#: score about 0.65, so only learnt id embeddings get here (2,000 users and 5,000 items:
#: with 2,500 lines a file the model learnt them too seldom and stayed near 0.70).
MIN_AUC = 0.72
LINES = 5000  # a file's lines; 4 training files, 1 test file
SMALL = ["datafeed.generated.train_files=4", "datafeed.generated.test_files=1",
         f"datafeed.generated.lines_per_file={LINES}", "ctr.epochs=3",
         "datafeed.print_period_s=0.2"]


def ctr_args(tmp_path, *overrides):
    return ["+experiment=ctr_datafeed", f"run_dir={tmp_path / 'run'}",
            f"datafeed.generated.cache_dir={tmp_path / 'cache'}", *SMALL, *overrides]


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
    result = run_kspipe(*ctr_args(tmp_path, "datafeed.fetch=[loss,tower_out.b]",
                                  "datafeed.print_period=20", *overrides), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_auc"] >= MIN_AUC, metrics
    assert metrics["test_instances"] == LINES and metrics["train_instances"] == 3 * 4 * LINES
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
    assert steps[-1] == 3 * 4 * LINES and len(steps) >= 3
    data_dir = glob.glob(str(tmp_path / "cache" / "ctr-*"))[0]
    assert exported_auc(tmp_path / "run" / "inference_model", data_dir) == pytest.approx(
        metrics["test_auc"], abs=1e-6)


def test_ctr_trains_on_a_parameter_server_cluster(tmp_path):
    result = run_kspipe(*ctr_args(tmp_path, "mode=pserver", "workers=2", "cluster.timeout_s=300"),
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_auc"] >= MIN_AUC, metrics
    # each worker trained on its half of the files
    assert metrics["train_instances"] == 3 * 2 * LINES
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
        metrics["test_auc"], abs=1e-6)


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
                lines.append(f"1 {int(ids[0] % 2)} {len(ids)} {' '.join(map(str, ids))} "
                             f"1 {rng.normal():.3f}")
            (tmp_path / folder / f"part-{f}").write_text("\n".join(lines) + "\n")
    return tmp_path


def own_args(tmp_path, *overrides):
    return ["+experiment=ctr_datafeed", f"run_dir={tmp_path / 'run'}",
            f"datafeed.desc={tmp_path / 'desc.prototxt'}",
            f"datafeed.train_files={tmp_path / 'train'}",
            f"datafeed.test_files={tmp_path / 'test'}", "ctr.epochs=1", *overrides]


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
    result = run_kspipe(*own_args(own_files, f"mode={mode}", "workers=2", "cluster.timeout_s=120"),
                        cwd=own_files)
    assert_one_line_error(result, f"{bad}:7: the value count of slot 'price' is '0.5'")
    assert "FINISHED" not in run_statuses(own_files / "mlflow.db")


@pytest.mark.parametrize("change, fragments", [
    (lambda d: corrupt(d / "train" / "part-0", 3, "1 1 2 4 abc 1 0.5"),
     ["part-0:3: slot 'ids' is uint64 but holds 'abc'"]),
    (lambda d: corrupt(d / "test" / "part-0", 2, "1 1 1 4 1 0.5x"),
     ["test/part-0:2: slot 'price' is float but holds '0.5x'"]),
    (lambda d: corrupt(d / "train" / "part-0", 1, "1 7 1 4 1 0.5"),
     ["part-0:1: label slot 'label' holds 7"]),
    (lambda d: os.remove(d / "train" / "part-0") or os.remove(d / "train" / "part-1"),
     ["datafeed.train_files: folder", "has no files"]),
    (lambda d: (d / "desc.prototxt").write_text(DESC.replace('"float"', '"double"')),
     ["has type 'double'"]),
])
def test_bad_data_is_one_clear_line(own_files, change, fragments):
    change(own_files)
    result = run_kspipe(*own_args(own_files), cwd=own_files)
    assert_one_line_error(result, *fragments)
    assert "FINISHED" not in run_statuses(own_files / "mlflow.db")


@pytest.mark.parametrize("overrides, fragments", [
    (["datafeed.train_files=[/nowhere/part-0]"], ["datafeed.train_files: no such file: /nowhere/part-0"]),
    (["datafeed.train_files=[]"], ["datafeed.train_files: the file list is empty"]),
    (["datafeed.desc=null"], ["datafeed.desc and datafeed.train_files go together"]),
    (["datafeed.label=click"], ["datafeed.label='click'", "slots: label, ids, price"]),
    (["datafeed.threads=0"], ["datafeed.threads=0 must be at least 1"]),
    (["datafeed.dataset=hdfs"], ["datafeed.dataset='hdfs'"]),
    (["datafeed.fetch=[no_such_var]"], ["datafeed.fetch: the program has no variable 'no_such_var'"]),
    (["mode=collective"], ["mode=collective cannot run the ctr workload",
                           "train_from_dataset's reader threads"]),
    (["mode=pserver", "cluster.strategy=sync"], ["cluster.strategy=sync", "async"]),
    (["ctr.hash_size=0"], ["ctr.hash_size=0 must be at least 1"]),
    (["workers=3", "mode=pserver"], ["2 training file(s) for 3 workers"]),
])
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
        return compose_config(["+experiment=ctr_datafeed", f"run_dir={tmp_path}/run{threads}",
                               "tracking.enabled=false", "ctr.epochs=1",
                               "datafeed.generated.lines_per_file=200",
                               f"datafeed.generated.cache_dir={tmp_path}/cache",
                               f"datafeed.threads={threads}", f"isolate={isolate}"])

    # a test process may have trained from files already: use a count it has not
    from kspipe.ctr import training

    used = training._process_threads or 2  # the default, which other in-process tests use
    other = 2 if used == 1 else 1
    assert run(cfg(used, False), plugin_manager())["train_instances"] == 1600
    with pytest.raises(ConfigError, match=f"already trained from files with {used} reader"):
        run(cfg(other, False), plugin_manager())
    # isolated, the same job runs in a process of its own and succeeds
    metrics = run(cfg(other, True), plugin_manager())
    assert 0 <= metrics["test_auc"] <= 1 and (tmp_path / f"run{other}" / "logs" / "worker.0.log").exists()


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
                lines.append(f"1 {int(a % 2)} 2 {a} {b} 2 0.5 9.5 {len(w)} "
                             + " ".join(f"{x:.3f}" for x in w))
            (tmp_path / folder / f"part-{f}").write_text("\n".join(lines) + "\n")
    result = run_kspipe(*own_args(tmp_path, "ctr.epochs=3"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train_instances"] == 3 * 600
    assert metrics["test_auc"] > 0.9  # the label is the parity of the first id of "pair"
    import paddle

    paddle.enable_static()
    _, feeds, _ = paddle.static.load_inference_model(
        str(tmp_path / "run" / "inference_model" / "model"), paddle.static.Executor(paddle.CPUPlace()))
    assert feeds == ["pair", "w"]  # no label, no unused slot


def test_checkpoints_each_epoch_and_resumes(tmp_path):
    first = tmp_path / "first"
    args = [*ctr_args(tmp_path), "ctr.epochs=1"]
    result = run_kspipe(*[a for a in args if not a.startswith("run_dir=")], f"run_dir={first}",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in (first / "checkpoints").iterdir()] == ["checkpoint-0000001"]
    before = json.loads((first / "metrics.json").read_text())
    # nothing left to train: the restored weights score exactly as they did
    again = run_kspipe(*[a for a in args if not a.startswith("run_dir=")],
                       f"run_dir={tmp_path / 'again'}", f"resume={first}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after epoch 1" in again.stderr
    restored = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert restored["test_auc"] == before["test_auc"] and restored["train_instances"] == 0
    # one more epoch continues from there
    more = run_kspipe(*[a for a in args if not a.startswith("run_dir=")], "ctr.epochs=2",
                      f"run_dir={tmp_path / 'more'}", f"resume={first}", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    metrics = json.loads((tmp_path / "more" / "metrics.json").read_text())
    assert metrics["train_instances"] == 4 * LINES and metrics["test_auc"] >= MIN_AUC
    assert sorted(p.name for p in (tmp_path / "more" / "checkpoints").iterdir()) == [
        "checkpoint-0000002"]


@pytest.fixture(scope="module")
def on_servers(tmp_path_factory):
    """ctr on 2 servers and 2 workers, one epoch (its checkpoint holds the servers' shards);
    ``run(name, *overrides)`` runs more in the same folder."""
    tmp = tmp_path_factory.mktemp("servers")

    def run(name, *overrides, ok=True):
        result = run_kspipe(*[a for a in ctr_args(tmp, *CLUSTER) if not a.startswith("run_dir=")],
                            f"run_dir={tmp / name}", *overrides, cwd=tmp)
        if ok:
            assert result.returncode == 0, (name, result.stderr[-3000:])
        return result

    run("one", "ctr.epochs=1")
    return tmp, run


CLUSTER = ["mode=pserver", "workers=2", "servers=2", "cluster.timeout_s=300"]


def test_a_cluster_checkpoint_holds_every_servers_shard(on_servers):
    tmp, _ = on_servers
    (saved,) = (tmp / "one" / "checkpoints").iterdir()
    manifest = json.loads((saved / "tables" / "manifest.json").read_text())
    assert manifest["servers"] == 2
    tables = {t[0] for t in manifest["layout"]}
    assert len(tables) >= 4  # the user, item and tag tables and the dense tower
    for name, size in manifest["files"].items():
        assert (saved / "tables" / name).stat().st_size == size
    # each server wrote its own shard of a sparse table
    shards = {name.split("/")[-1] for name in manifest["files"]}
    assert sum(1 for n in shards if n.startswith("part-000")) >= 2, sorted(shards)


def test_resume_on_the_servers_restores_the_tables_and_goes_on(on_servers, monkeypatch):
    tmp, run = on_servers
    before = json.loads((tmp / "one" / "metrics.json").read_text())
    # nothing left to train: the restored tables score as the saved ones did (Paddle's servers
    # write their tables as text, 6 significant digits: the AUC moved by 8e-8 when seen)
    again = run("again", "ctr.epochs=1", f"resume={tmp / 'one'}")
    assert "resumed after epoch 1" in again.stderr
    restored = json.loads((tmp / "again" / "metrics.json").read_text())
    assert restored["train_instances"] == 0
    assert restored["test_auc"] == pytest.approx(before["test_auc"], abs=1e-6)
    assert restored["test_auc"] != 0.5  # not a fresh model's
    # one more epoch goes on from the restored tables. Async runs are not repeatable (Hogwild
    # threads, pulls on a timer), so a resumed run is not compared with an uninterrupted one
    # here (seen: two epochs 0.697-0.719 uninterrupted, 0.683-0.715 resumed); one epoch alone
    # scores 0.655-0.663, which is what a resume that lost the tables would score
    monkeypatch.setenv("PSERVER_DEBUG", "1")
    run("more", "ctr.epochs=2", f"resume={tmp / 'one'}")
    more = json.loads((tmp / "more" / "metrics.json").read_text())
    assert more["train_instances"] == 2 * LINES  # one epoch of this worker's two files
    assert more["test_auc"] > before["test_auc"] + 0.01, (more, before)
    # Paddle's servers save a dense table's Adam moments but not its powers: the resumed
    # servers start them where the saved run's pushes left them (PSERVER_DEBUG prints the
    # servers' table descriptions). A push is a batch of a reader thread (2 workers, 2
    # threads, a file of LINES lines each, batches of 64), counted by an op that the
    # threads may race on
    (saved,) = (tmp / "one" / "checkpoints").iterdir()
    pushes = json.loads((saved / "tables" / "manifest.json").read_text())["dense_pushes"]
    assert 4 * math.ceil(LINES / 64) - 3 <= pushes <= 4 * math.ceil(LINES / 64)
    for server in (0, 1):
        log = (tmp / "more" / "logs" / f"server.{server}.log").read_text()
        dense = log[log.index('table_name: "MergedDense"'):].split("}")[0]
        starts = [float(v.split("&")[-1]) for v in re.findall(r'initializers: "([^"]+)"', dense)]
        params = re.findall(r'params: "([^"]+)"', dense)
        beta2_pow = starts[params.index("Beta2Pow")]
        assert beta2_pow == pytest.approx(0.999 * 0.999 ** (10 * pushes), rel=1e-6)
        assert starts[params.index("Beta1Pow")] < 1e-30


def test_damaged_or_mismatched_server_tables_are_one_line(on_servers):
    tmp, run = on_servers
    damaged = tmp / "damaged"
    shutil.copytree(tmp / "one", damaged)
    (saved,) = (damaged / "checkpoints").iterdir()
    manifest = json.loads((saved / "tables" / "manifest.json").read_text())
    name = max(manifest["files"], key=manifest["files"].get)
    with open(saved / "tables" / name, "r+b") as f:
        f.truncate(manifest["files"][name] // 2)
    result = run("from-damaged", "ctr.epochs=1", f"resume={damaged}", ok=False)
    assert_one_line_error(result, f"{saved / 'tables' / name}: a server's table shard is damaged")
    result = run("other-servers", "ctr.epochs=1", "servers=1", f"resume={tmp / 'one'}", ok=False)
    assert_one_line_error(result, "the tables were saved by 2 server(s), this job has 1")


def test_a_cluster_model_goes_on_in_one_process_and_back(on_servers):
    """init_from: the servers' shards and the workers' state of a cluster run become one
    process's model (the same rows, the same tower), which trains on; its model goes back
    onto a cluster of another number of servers and scores exactly as it did."""
    from kspipe.modes.tables import read_table_rows

    tmp, _ = on_servers

    def local(name, *overrides):
        result = run_kspipe(*[a for a in ctr_args(tmp) if not a.startswith("run_dir=")],
                            f"run_dir={tmp / name}", *overrides, cwd=tmp)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        return result, json.loads((tmp / name / "metrics.json").read_text())

    (saved,) = (tmp / "one" / "checkpoints").iterdir()
    source = json.loads((tmp / "one" / "metrics.json").read_text())
    result, same = local("in-one-process", "ctr.epochs=0", f"init_from={tmp / 'one'}")
    assert "starting from the model in" in result.stderr
    model = exported_params(tmp / "in-one-process" / "inference_model")
    tables = read_table_rows(str(saved / "tables"))
    assert set(tables) == {"emb_user", "emb_item", "emb_tags"}
    for name, (ids, rows) in tables.items():
        assert len(ids) >= 100  # 300 tags, thousands of users and items
        np.testing.assert_array_equal(model[name][ids], rows)
    with open(saved / "state.pdparams", "rb") as f:
        tower = pickle.load(f)
    for name, value in tower.items():
        np.testing.assert_array_equal(model[name], value)
    # ids of the test file the source never trained on take each run's own first values
    assert same["test_auc"] == pytest.approx(source["test_auc"], abs=2e-3)

    _, onwards = local("onwards", "ctr.epochs=1", f"init_from={tmp / 'one'}")
    assert onwards["train_instances"] == 4 * LINES
    assert (tmp / "onwards" / "checkpoints" / "checkpoint-0000001").is_dir()
    back = run_kspipe(*[a for a in ctr_args(tmp, *CLUSTER) if not a.startswith("run_dir=")],
                      "servers=1", "ctr.epochs=0", f"init_from={tmp / 'onwards'}",
                      f"run_dir={tmp / 'back'}", cwd=tmp)
    assert back.returncode == 0, back.stderr[-3000:]
    assert not (tmp / "back" / "init_from").exists()  # the rows' files, once the servers read them
    # every row of the one-process table went onto the servers: the same scores
    back = json.loads((tmp / "back" / "metrics.json").read_text())
    assert back["test_auc"] == pytest.approx(onwards["test_auc"], abs=1e-6)


def exported_params(model_dir) -> dict:
    """Every persistable of an exported inference model, by name."""
    import paddle

    paddle.enable_static()
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        program, _, _ = paddle.static.load_inference_model(f"{model_dir}/model", exe)
    return {v.name: np.array(scope.find_var(v.name).get_tensor()) for v in program.list_vars()
            if v.persistable and scope.find_var(v.name) is not None
            and v.name not in ("feed", "fetch")}


def test_a_server_killed_while_checkpointing_leaves_the_last_checkpoint(tmp_path):
    """kill -9 of a server while the servers write their shards: the job fails in one line,
    no process is left, and resume= continues from the last complete checkpoint."""
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    args = [*ctr_args(tmp_path, *CLUSTER), "ctr.epochs=8"]
    job = subprocess.Popen([sys.executable, "-m", "kspipe.cli", *args], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints, killed = run_dir / "checkpoints", None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and job.poll() is None:
            writing = [p for p in checkpoints.glob("checkpoint-*.tmp")
                       if p.name > "checkpoint-0000002.tmp"] if checkpoints.is_dir() else []
            if writing:  # a checkpoint after the second is being written: kill a server
                killed = writing[0].name
                os.kill(server_pid(run_dir), signal.SIGKILL)
            time.sleep(0.001)
        assert killed, "no checkpoint was seen being written"
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert stderr.strip().splitlines()[-1].startswith("kspipe: error:"), stderr[-2000:]
    assert not job_processes(run_dir)
    complete = sorted(p.name for p in checkpoints.iterdir() if not p.name.endswith(".tmp"))
    assert complete and complete[-1] < killed.removesuffix(".tmp"), (complete, killed)
    epoch = int(complete[-1].split("-")[1])
    again = run_kspipe(*[a for a in args if not a.startswith("run_dir=")],
                       f"run_dir={tmp_path / 'again'}", f"resume={run_dir}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed after epoch {epoch}" in again.stderr
    metrics = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert metrics["train_instances"] == (8 - epoch) * 2 * LINES  # this worker's 2 files
    assert metrics["test_auc"] >= MIN_AUC - 0.05


def server_pid(run_dir) -> int:
    for pid in job_processes(run_dir):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"TRAINING_ROLE=PSERVER" in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    raise AssertionError("no server process found")


def test_a_cluster_started_from_another_model_is_one_line(on_servers):
    tmp, run = on_servers
    result = run("other-shape", "ctr.epochs=1", "ctr.embedding_dim=4",
                 f"init_from={tmp / 'one'}", ok=False)
    assert_one_line_error(result, f"init_from={tmp / 'one'}: ", "was saved by another model")
    assert not job_processes(tmp / "other-shape")
    import sqlite3

    with sqlite3.connect(tmp / "mlflow.db") as con:
        assert not con.execute("select 1 from runs where status = 'RUNNING'").fetchall()
