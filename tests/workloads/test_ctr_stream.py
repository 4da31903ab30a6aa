"""ctr.stream (issue 48, points 4 and 5): a two-day PaddleRec online layout trained pass
by pass on 2 workers and 2 servers, validated before each pass, saved as deltas and a
base a day, evicted at each day's end, and resumed from its saves.  Each test checks the
servers' rows (every field of every row, as the servers write them) against a reference:
the same stream's rows before it stopped, or a day's end computed from them."""

import gzip
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kspipe.ctr.stream import layout
from kspipe.ctr.stream.generated import write_stream
from kspipe.errors import DataError
from kspipe.testing import assert_one_line_error, begun_store, compose_config, run_kspipe
from tests.kit.processes import environment_of, job_processes

DAYS = ("20190720", "20190721")
FOLDERS = ["0000", "0030", "0100", "0130"]
DECAY, DELETE, NONCLK = 0.5, 0.3, 0.1


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """Two days of 4 folders (2 passes of 2), 150 lines a folder; on the first day two
    folders more that hold no file (a pass with no files)."""
    root = tmp_path_factory.mktemp("stream")
    write_stream(str(root / "logs"), DAYS[0], 2, FOLDERS, 150)
    write_stream(str(root / "heldout"), "20190722", 1, ["0000"], 150, seed=1)
    for name in ("0200", "0230"):
        (root / "logs" / DAYS[0] / name).mkdir()
    return root


def args(root, name, *overrides):
    return [
        "+experiment=ctr_stream",
        "workers=2",
        "servers=2",
        f"run_dir={root / name}",
        f"tracking.uri={begun_store(root)}",
        f"ctr.stream.root={root / 'logs'}",
        f"ctr.stream.start_day={DAYS[0]}",
        f"ctr.stream.end_day={DAYS[1]}",
        "ctr.stream.split_interval=30",
        "ctr.stream.split_per_pass=2",
        "ctr.stream.dump_tables=true",
        "datafeed.format=slot",
        "datafeed.label_slot=1",
        f"ctr.table.accessor.ctr_accessor_param.show_click_decay_rate={DECAY}",
        f"ctr.table.accessor.ctr_accessor_param.delete_threshold={DELETE}",
        "cluster.timeout_s=300",
        *overrides,
    ]


def rows(folder) -> dict:
    """``{(table id, row id): the row's saved line}`` of the sparse tables in ``folder``."""
    import json

    layout_ = json.loads((folder / "manifest.json").read_text())["layout"]
    found = {}
    for table_id, kind, *_ in layout_:
        if kind != "MemorySparseTable":
            continue
        for file in sorted((folder / f"{table_id:03d}").iterdir()):
            with gzip.open(file, "rt") as f:
                for line in f:
                    found[(table_id, int(line.split(" ", 1)[0]))] = line.split()
    return found


def day_end(before: dict) -> dict:
    """The rows ``before`` after a day's end, computed: each ages a day (unseen days + 1),
    its show and click decay, and it is deleted if its score falls below the threshold."""
    after = {}
    for key, fields in before.items():
        fields = list(fields)
        fields[2] = repr(float(fields[2]) + 1)
        show, click = float(fields[4]) * DECAY, float(fields[5]) * DECAY
        if NONCLK * (show - click) + click < DELETE:
            continue
        fields[4], fields[5] = show, click
        after[key] = fields
    return after


def same_rows(saved: dict, reference: dict) -> None:
    assert sorted(saved) == sorted(reference)  # no row more, none less
    for key, fields in reference.items():
        got = saved[key]
        assert got[0] == fields[0] and got[3] == fields[3], key  # id's slot, delta score
        assert float(got[2]) == float(fields[2]), key  # unseen days
        assert float(got[4]) == pytest.approx(float(fields[4]), rel=1e-5), key  # show
        assert float(got[5]) == pytest.approx(float(fields[5]), rel=1e-5), key  # click
        assert got[6:] == fields[6:], key  # weights and optimiser state, as written


@pytest.fixture(scope="module")
def stream(logs):
    result = run_kspipe(*args(logs, "stream"), cwd=logs)
    assert result.returncode == 0, result.stderr[-3000:]
    return logs / "stream", result.stderr


def test_a_stream_trains_pass_by_pass_and_ends_each_day(logs, stream):
    """Four passes numbered 1-4 (the empty pass skipped in one line), each validated on
    before it trains from the second on, a delta after each and a base at each day's end,
    whose rows are the day's last rows aged, decayed and evicted (computed here); MLflow
    has the metrics stepped by pass."""
    import mlflow

    run_dir, stderr = stream
    assert f"pass {DAYS[0]} 0200-0230: its folders hold no file, skipped" in stderr
    assert "day 20190720: 21 pass(es) with no folder (0300...), skipped" in stderr
    for n in range(1, 5):
        assert f"delta checkpoint-{n:07d} after pass {n}" in stderr
    assert "pass 4, before training on it: 300 instances" in stderr
    tables = run_dir / "stream-tables"
    for day, last in ((DAYS[0], 2), (DAYS[1], 4)):
        same_rows(rows(tables / f"base-{day}"), day_end(rows(tables / f"pass-{last}")))
    # a delta holds exactly the rows trained since the last save: every id of its pass
    ids_of_pass_3 = {k[1] for k in rows_of_delta(run_dir / "checkpoints" / "checkpoint-0000003")}
    assert ids_of_pass_3 == ids_in(logs / "logs" / DAYS[1], FOLDERS[:2])
    client = mlflow.tracking.MlflowClient(str(begun_store(logs)))
    (run,) = [
        r
        for r in client.search_runs(client.search_experiments()[0].experiment_id)
        if r.data.params.get("ctr.stream.root")
    ]
    steps = lambda key: [m.step for m in client.get_metric_history(run.info.run_id, key)]  # noqa: E731
    assert steps("pass/auc") == [1, 2, 3, 4]
    assert steps("pass/test_auc") == [2, 3, 4]
    assert sorted(set(steps("table/emb_2/rows"))) == [1, 2, 3, 4]
    last_test = client.get_metric_history(run.info.run_id, "pass/test_auc")[-1].value
    assert run.data.metrics["test_auc"] == pytest.approx(last_test)


def rows_of_delta(checkpoint) -> dict:
    found = {}
    tables = checkpoint / "tables"
    for table in (t for t in tables.iterdir() if t.is_dir()):
        for file in table.iterdir():
            if file.suffix != ".gz":
                for line in file.read_text().splitlines():
                    found[(int(table.name), int(line.split(" ", 1)[0]))] = line
    return found


def ids_in(day, folders) -> set:
    ids = set()
    for name in folders:
        for file in (day / name).iterdir():
            for line in file.read_text().split():
                value, _, slot = line.rpartition(":")
                if slot != "1":
                    ids.add(int(value))
    return ids


def test_a_resume_rebuilds_the_tables_row_for_row_skipping_a_save_cut_short(logs, stream):
    """The stream's last save cut short (a shard truncated): resume= says so in one line,
    rebuilds the tables of the save before (the day's base and the next pass's delta)
    and they are the uninterrupted stream's rows after that pass, every field."""
    run_dir, _ = stream
    again = logs / "again"
    shutil.copytree(run_dir, again)
    shutil.rmtree(again / "stream-tables")
    shard = next((again / "checkpoints" / "checkpoint-0000004" / "tables" / "000").iterdir())
    shard.write_bytes(shard.read_bytes()[:-10])
    result = run_kspipe(*args(logs, "again", f"resume={again}"), cwd=logs)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint-0000004 cannot be resumed" in result.stderr
    assert "resumed after pass 3 from checkpoint-0000003" in result.stderr
    same_rows(
        rows(again / "stream-tables" / "restored-3"), rows(run_dir / "stream-tables" / "pass-3")
    )


def test_a_worker_killed_mid_pass_resumes_and_ends_the_day_on_the_rows_it_saved(logs):
    """A worker killed in the middle of a pass (the first day's last: validated on, being
    trained, not saved): cluster.max_restarts restarts the stream from the pass before's
    delta, its tables rebuilt from the deltas alone (no base yet) equal, row for row, those
    the stream held at that save, and the day's end after the pass trained again gives the
    rows computed from that pass's.  The exported model then holds the rows of the
    stream's last base, and scores a held-out pass exactly as the cluster's evaluation did."""
    run_dir = logs / "killed"
    heldout = logs / "heldout" / "20190722" / "0000"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            *args(logs, "killed", "cluster.max_restarts=1", f"datafeed.test_files={heldout}"),
        ],
        cwd=logs,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "stream-tables" / "pass-1" / "manifest.json").exists():
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.001)
        (first,) = [
            pid
            for pid in job_processes(run_dir)
            if environment_of(pid).get("TRAINING_ROLE") == "TRAINER"
            and environment_of(pid).get("PADDLE_TRAINER_ID") == "0"
        ]
        os.kill(first, signal.SIGKILL)  # in pass 2: its validation or its training
        assert not (run_dir / "checkpoints" / "checkpoint-0000002").exists()
        _, stderr = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert "restart 1 of 1 from checkpoint-0000001" in stderr
    tables = run_dir / "stream-tables"
    same_rows(rows(tables / "restored-1"), rows(tables / "pass-1"))
    same_rows(rows(tables / f"base-{DAYS[0]}"), day_end(rows(tables / "pass-2")))
    served_as_the_cluster(run_dir, rows(tables / f"base-{DAYS[1]}"))


def served_as_the_cluster(run_dir, held: dict) -> None:
    import json

    import numpy as np
    import paddle

    from kspipe.ctr.evaluation import roc_auc
    from kspipe.datafeed import DataFeedDesc, python_batches

    paddle.enable_static()
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    desc = sorted((run_dir / "converted").glob("slots-*.prototxt"))[0]  # each process its own
    desc = DataFeedDesc(str(desc))
    labels, scores = [], []
    with paddle.static.scope_guard(scope):
        program, feeds, fetch = paddle.static.load_inference_model(
            str(run_dir / "inference_model" / "model"), exe
        )
        for table_id, slot in enumerate(("2", "3", "4")):
            keys = np.array(scope.find_var(f"emb_{slot}.keys").get_tensor()).view(np.uint64)
            assert sorted(keys.tolist()) == sorted(i for t, i in held if t == table_id), slot
        test = sorted((run_dir / "converted" / "test").iterdir())
        for feed in python_batches(test, desc, 16, {}):
            labels.append(np.array(feed["label"]).ravel())
            (pred,) = exe.run(program, feed={k: feed[k] for k in feeds}, fetch_list=fetch)
            scores.append(pred.ravel())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["test_instances"] == 150
    assert roc_auc(np.concatenate(labels), np.concatenate(scores)) == metrics["test_auc"]


def test_a_new_stream_starts_from_a_saved_base(logs, stream):
    """init_from= a finished stream's run folder (its last save: the last day's base)
    starts a new stream whose first save is that model, row for row (ids and weights;
    shows, clicks and optimiser state start afresh); a delta is refused in one line."""
    from kspipe.checkpoint.tables import read_table_rows

    run_dir, _ = stream
    result = run_kspipe(
        *args(logs, "onwards", f"init_from={run_dir}", f"ctr.stream.end_day={DAYS[0]}"),
        cwd=logs,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    source = read_table_rows(str(run_dir / "stream-tables" / f"base-{DAYS[1]}"))
    start = read_table_rows(str(logs / "onwards" / "stream-tables" / "start"))
    for name, (ids, weights) in source.items():
        order, again = np.argsort(ids), np.argsort(start[name][0])
        assert (start[name][0][again] == ids[order]).all(), name
        assert np.array_equal(start[name][1][again], weights[order]), name
    partial = logs / "partial"
    shutil.copytree(run_dir / "checkpoints", partial / "checkpoints")
    shutil.rmtree(partial / "checkpoints" / "checkpoint-0000004")
    refused = run_kspipe(*args(logs, "from-delta", f"init_from={partial}"), cwd=logs)
    assert_one_line_error(refused, "is a stream's delta")


def test_bad_stream_input_is_one_line(logs, tmp_path):
    """A day folder missing, a donefile that never comes, thresholds whose deltas would
    leave trained rows out, a stream outside mode=pserver: one line each."""
    s = compose_config(args(logs, "bad")).ctr.stream
    s.end_day = "20190722"
    with pytest.raises(DataError, match="day folder .*20190722 is missing"):
        layout.check(s)
    s.end_day, s.donefile, s.data_timeout_s, s.data_sleep_second = DAYS[1], "done", 30, 10
    waited = []
    p = layout.passes(s, DAYS[0])[0]
    with pytest.raises(DataError, match="0000/done did not come within 30 s"):
        layout.files(s, p, clock=lambda: sum(waited), sleep=waited.append)
    assert waited == [10, 10, 10]
    (logs / "logs" / DAYS[0] / "0000" / "done").touch()
    (logs / "logs" / DAYS[0] / "0030" / "done").touch()
    try:
        assert len(layout.files(s, p)) == 4  # the donefile itself is not data
    finally:
        for name in ("0000", "0030"):
            (logs / "logs" / DAYS[0] / name / "done").unlink()
    for overrides, fragment in (
        (["ctr.table.accessor.ctr_accessor_param.base_threshold=1.5"], "base_threshold=1.5"),
        (["ctr.table.accessor.ctr_accessor_param.delta_threshold=0.25"], "at most that"),
        (["mode=local"], "ctr.stream needs mode=pserver"),
        (["ctr.stream.end_day=20190730"], "20190722 is missing"),
    ):
        result = run_kspipe(*args(logs, "bad", *overrides), cwd=tmp_path)
        assert_one_line_error(result, fragment)
        assert not (logs / "bad" / "logs").exists()  # no process started
