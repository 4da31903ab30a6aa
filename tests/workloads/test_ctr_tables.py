"""ctr on parameter servers, checkpointed: every server's shard of the tables in each
checkpoint, a job resumed on the servers, a cluster's model continued in one process and
back, a job resumed on other numbers of workers and servers (the tables split anew),
damaged or mismatched tables and a server killed mid-checkpoint, each one line or the
last whole checkpoint."""

import gzip
import json
import math
import os
import pickle
import re
import shutil
import time

import numpy as np
import pytest

from kspipe.checkpoint.tables import check_manifest, reshard
from kspipe.testing import assert_one_line_error, run_kspipe
from tests.kit import (
    CTR_LINES,
    CTR_MIN_AUC,
    ctr_overrides,
    disk_size,
    job_processes,
    mounts_missing,
    small_disk,
)


@pytest.fixture(scope="module")
def on_servers(tmp_path_factory):
    """ctr on 2 servers and 2 workers, one epoch (its checkpoint holds the servers' shards);
    ``run(name, *overrides)`` runs more in the same folder."""
    tmp = tmp_path_factory.mktemp("servers")

    def run(name, *overrides, ok=True):
        result = run_kspipe(
            *[a for a in ctr_overrides(tmp, *CLUSTER) if not a.startswith("run_dir=")],
            f"run_dir={tmp / name}",
            *overrides,
            cwd=tmp,
        )
        if ok:
            assert result.returncode == 0, (name, result.stderr[-3000:])
        return result

    run("one", "ctr.epochs=1")
    return tmp, run


#: hashed ids: a model that moves between one process and the servers keeps its rows (raw
#: ids on the servers: test_ctr_sparse.py)
CLUSTER = ["mode=pserver", "workers=2", "servers=2", "cluster.timeout_s=300", "ctr.ids=hashed"]


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
    # threads, pulls on a timer), and their test AUC after one epoch and after two overlap
    # (seen: 0.691-0.711 one, 0.719-0.756 two resumed), so the running train AUC tells:
    # each batch is scored before its update, and the AUC's counts come back with the
    # checkpoint, so the resumed run's pools the saved epoch's with the new one's, scored
    # by a model that saw these files once if the tables came back, by a fresh one if not,
    # which pools to a first epoch's (seen: 0.025-0.045 above the saved run's, whose own
    # were 0.646-0.670, 5 runs, 2 of them on a machine kept busy)
    monkeypatch.setenv("PSERVER_DEBUG", "1")
    run("more", "ctr.epochs=2", f"resume={tmp / 'one'}")
    more = json.loads((tmp / "more" / "metrics.json").read_text())
    assert more["train_instances"] == 2 * CTR_LINES  # one epoch of this worker's two files
    assert more["train_auc"] > before["train_auc"] + 0.03, (more, before)
    # Paddle's servers save a dense table's Adam moments but not its powers: the resumed
    # servers start them where the saved run's pushes left them (PSERVER_DEBUG prints the
    # servers' table descriptions). A push is a batch of a reader thread (2 workers, 2
    # threads, a file of CTR_LINES lines each, batches of 64), counted by an op that the
    # threads may race on
    (saved,) = (tmp / "one" / "checkpoints").iterdir()
    pushes = json.loads((saved / "tables" / "manifest.json").read_text())["dense_pushes"]
    assert 4 * math.ceil(CTR_LINES / 64) - 3 <= pushes <= 4 * math.ceil(CTR_LINES / 64)
    for server in (0, 1):
        log = (tmp / "more" / "logs" / f"server.{server}.log").read_text()
        dense = log[log.index('table_name: "MergedDense"') :].split("}")[0]
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


def shard_lines(folder) -> dict:
    """``{file name: its lines}`` of a table's shards."""
    lines = {}
    for file in sorted(os.listdir(folder)):
        with gzip.open(os.path.join(folder, file), "rt") as f:
            lines[file] = f.readlines()
    return lines


def test_a_resume_on_other_numbers_splits_the_tables_anew(on_servers, tmp_path):
    """The 2-server checkpoint split for 3 servers holds every saved line (a row with its
    accessor values and Adam state, a dense value with its moments) once, on the server
    the new layout gives it; a job of 3 workers and 1 server resumed from it scores as
    the saved run did."""
    tmp, run = on_servers
    (saved,) = (tmp / "one" / "checkpoints").iterdir()
    manifest = json.loads((saved / "tables" / "manifest.json").read_text())
    layout = [tuple(t[:5]) + (tuple(t[5]),) for t in manifest["layout"]]
    split = reshard(str(saved / "tables"), str(tmp_path / "three"), 3, layout)
    check_manifest(split, 3, layout)
    assert (
        json.loads((tmp_path / "three" / "manifest.json").read_text())["dense_pushes"]
        == (manifest["dense_pushes"])
    )
    for table_id, kind, name, fea_dim, _, _ in layout:
        if not kind.endswith(("SparseTable", "DenseTable")):
            continue
        before = shard_lines(saved / "tables" / f"{table_id:03d}")
        after = shard_lines(tmp_path / "three" / f"{table_id:03d}")
        if kind == "MemorySparseTable":
            assert list(after) == [f"part-{s:03d}-{s:05d}.gz" for s in range(3)], name
            for server, lines in enumerate(after.values()):
                assert all(int(line.split()[0]) % 3 == server for line in lines), name
            assert sorted(sum(after.values(), [])) == sorted(sum(before.values(), [])), name
        else:  # the values in order, in slices of fea_dim // 3 + 1
            assert list(after) == [f"part-{s:03d}.gz" for s in range(3)], name
            per = fea_dim // 3 + 1
            assert [len(v) for v in after.values()] == [per, per, fea_dim - 2 * per], name
            assert sum(after.values(), []) == sum(before.values(), []), name

    score = json.loads((tmp / "one" / "metrics.json").read_text())["test_auc"]
    resized = run("resized", "ctr.epochs=1", "workers=3", "servers=1", f"resume={tmp / 'one'}")
    assert (
        f"kspipe: resumes {saved.name} of 2 workers and 2 servers on 3 workers and 1 "
        f"server; tables re-sharded\n"
    ) in resized.stderr
    restored = json.loads((tmp / "resized" / "metrics.json").read_text())
    assert restored["train_instances"] == 0  # nothing left to train: the tables as saved
    assert restored["test_auc"] == pytest.approx(score, abs=1e-6)
    assert not (tmp / "resized" / "resharded-tables").exists()


def test_a_cluster_model_goes_on_in_one_process_and_back(on_servers):
    """init_from: the servers' shards and the workers' state of a cluster run become one
    process's model (the same rows, the same tower), which trains on; its model goes back
    onto a cluster of another number of servers and scores exactly as it did."""
    from kspipe.checkpoint.tables import read_table_rows

    tmp, _ = on_servers

    def local(name, *overrides):
        result = run_kspipe(
            *[a for a in ctr_overrides(tmp) if not a.startswith("run_dir=")],
            f"run_dir={tmp / name}",
            *overrides,
            cwd=tmp,
        )
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
    assert onwards["train_instances"] == 4 * CTR_LINES
    assert (tmp / "onwards" / "checkpoints" / "checkpoint-0000001").is_dir()
    back = run_kspipe(
        *[a for a in ctr_overrides(tmp, *CLUSTER) if not a.startswith("run_dir=")],
        "servers=1",
        "ctr.epochs=0",
        f"init_from={tmp / 'onwards'}",
        f"run_dir={tmp / 'back'}",
        cwd=tmp,
    )
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
    return {
        v.name: np.array(scope.find_var(v.name).get_tensor())
        for v in program.list_vars()
        if v.persistable and scope.find_var(v.name) is not None and v.name not in ("feed", "fetch")
    }


def test_a_server_killed_while_checkpointing_leaves_the_last_checkpoint(tmp_path):
    """kill -9 of a server while the servers write their shards: the job fails in one line,
    no process is left, and resume= takes up the last complete checkpoint: the resumed
    servers hold its rows."""
    import signal
    import subprocess
    import sys
    import time

    from kspipe.checkpoint.tables import read_table_rows

    run_dir = tmp_path / "run"
    args = [*ctr_overrides(tmp_path, *CLUSTER), "ctr.epochs=8"]
    job = subprocess.Popen(
        [sys.executable, "-m", "kspipe.cli.command", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoints, killed = run_dir / "checkpoints", None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and job.poll() is None:
            writing = (
                [
                    p
                    for p in checkpoints.glob("checkpoint-*.tmp")
                    if p.name > "checkpoint-0000002.tmp"
                ]
                if checkpoints.is_dir()
                else []
            )
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
    # nothing left to train: the exported model, every row pulled from the resumed servers,
    # holds the checkpoint's rows exactly (after another epoch a fresh model's AUC is about
    # a trained one's, so it would not tell)
    again = run_kspipe(
        *[a for a in args if not a.startswith("run_dir=")],
        f"ctr.epochs={epoch}",
        f"run_dir={tmp_path / 'again'}",
        f"resume={run_dir}",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed after epoch {epoch}" in again.stderr
    metrics = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert metrics["train_instances"] == 0
    model = exported_params(tmp_path / "again" / "inference_model")
    tables = read_table_rows(str(checkpoints / complete[-1] / "tables"))
    assert set(tables) == {"emb_user", "emb_item", "emb_tags"}
    for name, (ids, rows) in tables.items():
        assert len(ids) >= 100, name
        np.testing.assert_array_equal(model[name][ids], rows, err_msg=name)
    assert metrics["test_auc"] >= CTR_MIN_AUC - 0.05


@pytest.mark.skipif(bool(mounts_missing()), reason=str(mounts_missing()))
def test_a_server_whose_disk_is_full_ends_the_job_in_one_line_not_a_hang(on_servers):
    """The run folder's disk holds the workers' part of a checkpoint but not the server's
    shard.  A server of Paddle 2.6.2 that cannot write a shard (after 3 tries) calls
    exit(-1) from a thread of its own, and its C++ destructors then waited for the
    workers' connections: the job hung until its save request's 3 hours ran out.  Now the
    server ends, and the job with it, in one line; nothing is left running and no
    checkpoint half-written."""
    tmp, _ = on_servers
    (saved,) = (tmp / "one" / "checkpoints").iterdir()
    workers_part = disk_size(saved) - disk_size(saved / "tables")
    one_server = [
        a for a in ctr_overrides(tmp, *CLUSTER) if not a.startswith(("run_dir=", "servers="))
    ] + ["servers=1", "ctr.epochs=1"]
    with small_disk(tmp / "full", workers_part + 128 * 1024) as disk:
        started = time.monotonic()
        result = run_kspipe(*one_server, f"run_dir={disk / 'run'}", cwd=tmp, timeout=300)
        took = time.monotonic() - started
        # the first worker says which shard is missing; if it is slower to exit than the
        # server (a loaded host), the line names the server's exit and its log's last error;
        # where the shards filled the disk whole, the first worker's next file is refused
        assert_one_line_error(result)
        line = result.stderr.strip().splitlines()[-1]
        assert (
            "server 0's shard of table" in line
            and "tables were not all saved" in line
            or "server 0 exited with status 255" in line
            or "a checkpoint could not be written: No space left on device" in line
        ), line
        assert result.returncode == 3
        assert took < 120, took
        assert not job_processes(disk / "run")
        assert not list((disk / "run" / "checkpoints").iterdir())


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
    result = run(
        "other-shape", "ctr.epochs=1", "ctr.embedding_dim=4", f"init_from={tmp / 'one'}", ok=False
    )
    assert_one_line_error(result, f"init_from={tmp / 'one'}: ", "was saved by another model")
    assert not job_processes(tmp / "other-shape")
    import sqlite3

    with sqlite3.connect(tmp / "mlflow.db") as con:
        assert not con.execute("select 1 from runs where status = 'RUNNING'").fetchall()
