"""kspipe ctr refresh (issue 48, point 7): a stream's served model brought up to a later
delta without a full export.  One stream on 2 workers and 2 servers saves a base after
day 1's pass, then day 2's two passes (a delta after the first, a base after the second);
the same stream resumed at that delta and stopped there exports the servers' tables as
they are at that delta.  The model refreshed from the base's model and the delta must be
that export, row for row and parameter for parameter, and score a held-out pass alike."""

import json
import shutil

import numpy as np
import pytest

from kspipe.cli.ctr import main
from kspipe.ctr.stream.generated import write_stream
from kspipe.ctr.stream.refresh import Model, refresh
from kspipe.testing import begun_store, run_kspipe

DAYS = ("20190720", "20190721")
FOLDERS = ["0000", "0030", "0100", "0130"]


def args(root, name, logs, *overrides):
    return [
        "+experiment=ctr_stream",
        "workers=2",
        "servers=2",
        f"run_dir={root / name}",
        f"tracking.uri={begun_store(root)}",
        f"ctr.stream.root={logs}",
        f"ctr.stream.start_day={DAYS[0]}",
        f"ctr.stream.end_day={DAYS[1]}",
        "ctr.stream.split_interval=30",
        "ctr.stream.split_per_pass=2",
        "datafeed.format=slot",
        "datafeed.label_slot=1",
        # no row evicted at a day's end: the base after a pass holds that pass's weights
        "ctr.table.accessor.ctr_accessor_param.delete_threshold=0",
        "cluster.timeout_s=300",
        *overrides,
    ]


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """``stream``: checkpoint-1 a base (day 1's one pass), checkpoint-2 a delta,
    checkpoint-3 a base; ``at_delta``: the stream resumed at checkpoint-2 with day 2's
    second pass holding no file, so it ends there (its day's end evicts nothing) and
    exports the tables of checkpoint-2, scoring a held-out pass."""
    root = tmp_path_factory.mktemp("refresh")
    logs = root / "logs"
    write_stream(str(logs), DAYS[0], 1, FOLDERS[:2], 100)
    write_stream(str(logs), DAYS[1], 1, FOLDERS, 100, seed=1)
    write_stream(str(root / "heldout"), "20190722", 1, ["0000"], 100, seed=2)
    result = run_kspipe(*args(root, "stream", logs), cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    for n, kind in ((1, "base"), (2, "delta"), (3, "base")):
        assert f"{kind} checkpoint-{n:07d} after pass {n}" in result.stderr
    cut = root / "cut-logs"  # day 2's second pass: folders that hold no file
    shutil.copytree(logs, cut)
    for name in FOLDERS[2:]:
        shutil.rmtree(cut / DAYS[1] / name)
        (cut / DAYS[1] / name).mkdir()
    at_delta = root / "at-delta"
    shutil.copytree(root / "stream" / "checkpoints", at_delta / "checkpoints")
    shutil.rmtree(at_delta / "checkpoints" / "checkpoint-0000003")
    heldout = root / "heldout" / "20190722" / "0000"
    result = run_kspipe(
        *args(root, "at-delta", cut, f"resume={at_delta}", f"datafeed.test_files={heldout}"),
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed after pass 2 from checkpoint-0000002" in result.stderr
    return root


def checkpoint(root, n: int):
    return root / "stream" / "checkpoints" / f"checkpoint-{n:07d}"


def test_a_model_refreshed_from_a_delta_is_the_full_export_at_that_delta(streams, tmp_path):
    """The base's model (built from checkpoint-1, --full) refreshed by the command from
    checkpoint-2 holds exactly the tables (ids and rows) and tower the cluster exported at
    checkpoint-2, and scores the held-out pass exactly as the cluster did."""
    root = streams
    exported = root / "at-delta" / "inference_model"
    base = tmp_path / "base"
    refresh(str(root / "stream" / "inference_model"), str(checkpoint(root, 1)), str(base), True)
    result = run_kspipe(
        "ctr",
        "refresh",
        str(base),
        str(checkpoint(root, 2)),
        "--output",
        str(tmp_path / "m"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "row(s) of 1 delta(s) merged" in result.stdout
    refreshed, full = Model(str(tmp_path / "m")), Model(str(exported))
    assert sorted(refreshed.tables) == sorted(full.tables) == ["emb_2", "emb_3", "emb_4"]
    for name, (keys, rows) in full.tables.items():
        assert np.array_equal(refreshed.tables[name][0], keys), name
        assert np.array_equal(refreshed.tables[name][1], rows), name
    assert sorted(refreshed.dense) == sorted(full.dense)
    for name, value in full.dense.items():
        assert np.array_equal(refreshed.dense[name], value), name
    assert json.loads((tmp_path / "m" / "stream.json").read_text())["pass"] == 2
    labels, scores = heldout_scores(root / "at-delta", tmp_path / "m")
    _, cluster = heldout_scores(root / "at-delta", exported)
    assert np.array_equal(scores, cluster)
    from kspipe.ctr.evaluation import roc_auc

    metrics = json.loads((root / "at-delta" / "metrics.json").read_text())
    assert roc_auc(labels, scores) == metrics["test_auc"]


def heldout_scores(run_dir, model):
    """The held-out pass (as the run converted it) scored by the exported ``model``."""
    import paddle

    from kspipe.datafeed import DataFeedDesc, python_batches

    paddle.enable_static()
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    desc = DataFeedDesc(str(sorted((run_dir / "converted").glob("slots-*.prototxt"))[0]))
    labels, scores = [], []
    with paddle.static.scope_guard(scope):
        program, feeds, fetch = paddle.static.load_inference_model(str(model / "model"), exe)
        for feed in python_batches(
            sorted((run_dir / "converted" / "test").iterdir()), desc, 16, {}
        ):
            labels.append(np.array(feed["label"]).ravel())
            (pred,) = exe.run(program, feed={k: feed[k] for k in feeds}, fetch_list=fetch)
            scores.append(pred.ravel())
    assert sum(len(y) for y in labels) == 100
    return np.concatenate(labels), np.concatenate(scores)


def test_the_full_model_of_a_base_is_the_streams_export_to_the_saved_digits(streams, tmp_path):
    """The stream's own export (the live servers' rows after its last base) serves that
    base (stream.json); the model built from the base's save has its ids exactly, and its
    rows and tower to the 6 significant digits the servers write."""
    root = streams
    exported = root / "stream" / "inference_model"
    assert (
        json.loads((exported / "stream.json").read_text())["checkpoint"] == checkpoint(root, 3).name
    )
    refresh(str(exported), str(checkpoint(root, 3)), str(tmp_path / "full"), full=True)
    built, live = Model(str(tmp_path / "full")), Model(str(exported))
    for name, (keys, rows) in live.tables.items():
        assert np.array_equal(built.tables[name][0], keys), name
        assert np.allclose(built.tables[name][1], rows, rtol=5e-6, atol=1e-9), name
    for name, value in live.dense.items():
        assert np.allclose(built.dense[name], value, rtol=5e-6, atol=1e-9), name


def test_a_refresh_never_skips_a_base_nor_goes_back(streams, tmp_path, capsys):
    """A base, a delta after another base than the model's, a save not after the model's:
    one line each, nothing written."""
    root = streams
    base = tmp_path / "base"
    refresh(str(root / "stream" / "inference_model"), str(checkpoint(root, 1)), str(base), True)
    later = tmp_path / "later" / "checkpoints"  # a delta after the base checkpoint-3
    shutil.copytree(checkpoint(root, 3), later / "checkpoint-0000003")
    shutil.copytree(checkpoint(root, 2), later / "checkpoint-0000004")
    progress = json.loads((later / "checkpoint-0000004" / "progress.json").read_text())
    (later / "checkpoint-0000004" / "progress.json").write_text(json.dumps(progress | {"pass": 4}))
    for model, save, fragment in (
        (base, checkpoint(root, 3), "checkpoint-0000003 is a base: a day's end evicted rows"),
        (base, later / "checkpoint-0000004", "a refresh cannot skip a base"),
        (root / "stream" / "inference_model", checkpoint(root, 2), "is not after the save"),
        (root / "stream" / "checkpoints", checkpoint(root, 2), "no exported model"),
    ):
        assert main(["refresh", str(model), str(save), "--output", str(tmp_path / "x")]) != 0
        (error,) = capsys.readouterr().err.splitlines()  # one line, no traceback
        assert error.startswith("kspipe: error: ") and fragment in error, error
        assert not (tmp_path / "x").exists()


def test_an_mlflow_model_is_refreshed_and_logged_again(streams, tmp_path):
    """The stream's MLflow model (models:/<id>) refreshed to a delta after its base and
    logged with --log as a new model of the stream's run, at the delta's pass."""
    from mlflow import MlflowClient

    root = streams
    uri = begun_store(root)
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = [
        r
        for r in client.search_runs(experiments)
        if r.data.params.get("ctr.stream.root") == str(root / "logs")
    ]
    (model,) = [
        m
        for m in client.search_logged_models(experiment_ids=experiments)
        if m.source_run_id == run.info.run_id
    ]
    later = tmp_path / "checkpoints"  # a delta (pass 4) after the stream's last base
    shutil.copytree(checkpoint(root, 3), later / "checkpoint-0000003")
    shutil.copytree(checkpoint(root, 2), later / "checkpoint-0000004")
    progress = json.loads((later / "checkpoint-0000004" / "progress.json").read_text())
    (later / "checkpoint-0000004" / "progress.json").write_text(json.dumps(progress | {"pass": 4}))
    output = tmp_path / "served"
    argv = ["refresh", f"models:/{model.model_id}", str(later / "checkpoint-0000004")]
    argv += ["--output", str(output), "--tracking-uri", uri, "--log", run.info.run_id]
    assert main(argv) == 0
    assert json.loads((output / "stream.json").read_text())["pass"] == 4
    outputs = client.get_run(run.info.run_id).outputs.model_outputs
    assert len(outputs) == 2 and max(o.step for o in outputs) == 4  # the stream's, then this
