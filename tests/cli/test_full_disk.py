"""A disk that refuses a write mid-run (full, read-only) ends the job in one line that
names what could not be written and what the run can resume from; the checkpoints
written before stay whole, and the MLflow run is recorded as FAILED.

The disks are real mounts (tests/kit/disks.py), so these tests need root.  The servers'
tables on a full disk are in workloads/test_ctr_tables.py.
"""

import json

import pytest

from kspipe.testing import (
    assert_one_line_error,
    begun_store,
    install_plugin,
    plugin_env,
    run_kspipe,
    run_statuses,
    tiny_overrides,
)
from tests.kit import disk_size, fill, mounts_missing, read_only, resize, small_disk

pytestmark = pytest.mark.skipif(bool(mounts_missing()), reason=str(mounts_missing()))


def job(tmp_path, tiny_data, run, *overrides, env=None):
    args = [a for a in tiny_overrides(tmp_path, tiny_data) if not a.startswith("run_dir=")]
    return run_kspipe(
        "+experiment=omniglot_5way",
        *args,
        f"run_dir={run}",
        "eval.baseline=false",
        *overrides,
        cwd=tmp_path,
        env=env,
    )


def test_a_checkpoint_on_a_full_disk_is_one_line_and_leaves_the_earlier_ones_whole(
    tmp_path, tiny_data
):
    """The disk holds three checkpoints and a little more: the job, which keeps three,
    stops at the fourth, says which checkpoint could not be written, and resumes from the
    third."""
    probe = tmp_path / "probe"
    result = job(
        tmp_path,
        tiny_data,
        probe,
        "train.meta_iters=2",
        "train.checkpoint_every=1",
        "eval.interval=100",
        "tracking.enabled=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = disk_size(probe / "checkpoints")  # two checkpoints (it keeps 2)
    with small_disk(tmp_path / "disk", two * 3 // 2 + 64 * 1024) as disk:
        run = disk / "run"
        result = job(
            tmp_path,
            tiny_data,
            run,
            "train.meta_iters=6",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=3",
            "eval.interval=100",
        )
        assert_one_line_error(
            result,
            "a checkpoint could not be written: No space left on device",
            f"(writing {run}/checkpoints/checkpoint-0000004)",
            f"the run is recorded as FAILED; resume={run} continues from its latest checkpoint",
        )
        assert result.returncode == 2
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert left == ["checkpoint-0000001", "checkpoint-0000002", "checkpoint-0000003"]
        assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
        resumed = job(
            tmp_path,
            tiny_data,
            tmp_path / "resumed",
            f"resume={run}",
            "train.meta_iters=6",
            "train.checkpoint_every=100",
            "eval.interval=100",
        )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from meta-iteration 3 " in resumed.stderr


def test_a_model_folder_on_a_read_only_disk_is_one_line_naming_the_file(tmp_path, tiny_data):
    run = tmp_path / "run"
    with read_only(run / "inference_model") as model:
        result = job(tmp_path, tiny_data, run, "train.meta_iters=2", "eval.interval=100")
    assert_one_line_error(
        result,
        f"Read-only file system: {model}/",
        f"the run is recorded as FAILED; resume={run} continues from its latest checkpoint",
    )
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]


def test_a_tracking_store_on_a_full_disk_is_one_line(tmp_path, tiny_data):
    """The MLflow store's disk fills between two runs: the second says so in one line (not
    SQLAlchemy's "Query-invoked autoflush" with the SQL MLflow logs before raising)."""
    with small_disk(tmp_path / "disk", 8 * 1024 * 1024) as disk:
        store = f"tracking.uri=sqlite:///{disk / 'mlflow.db'}"
        first = job(
            tmp_path,
            tiny_data,
            tmp_path / "first",
            store,
            "train.meta_iters=1",
            "eval.interval=100",
        )
        assert first.returncode == 0, first.stderr[-3000:]
        fill(disk / "filler")
        result = job(
            tmp_path,
            tiny_data,
            tmp_path / "second",
            store,
            "train.meta_iters=1",
            "eval.interval=100",
        )
    assert_one_line_error(
        result,
        f"tracking.uri={store[len('tracking.uri=') :]}: database or "
        f"disk is full; the run could not be made there",
    )
    assert "[SQL:" not in result.stderr and "autoflush" not in result.stderr, result.stderr


def test_a_new_tracking_store_on_a_disk_too_small_is_one_line_and_leaves_no_half_store(
    tmp_path, tiny_data
):
    """MLflow makes a new store in steps (its schema's migrations): a disk that fills among
    them would leave a file no later job can open ("table _alembic_tmp_... already
    exists").  The failed job says why in one line and leaves no file; once the disk has
    room, the next job makes the store (in the empty file left: the lock may be on it)."""
    with small_disk(tmp_path / "disk", 256 * 1024) as disk:
        store = f"sqlite:///{disk / 'mlflow.db'}"
        result = job(
            tmp_path,
            tiny_data,
            tmp_path / "first",
            f"tracking.uri={store}",
            "train.meta_iters=1",
            "eval.interval=100",
        )
        assert_one_line_error(
            result, f"tracking.uri={store}: cannot open the MLflow store: database or disk is full"
        )
        assert [(f.name, f.stat().st_size) for f in disk.iterdir()] == [("mlflow.db", 0)]
        resize(disk, 16 * 1024 * 1024)
        second = job(
            tmp_path,
            tiny_data,
            tmp_path / "second",
            f"tracking.uri={store}",
            "train.meta_iters=1",
            "eval.interval=100",
        )
        assert second.returncode == 0, second.stderr[-3000:]
        assert run_statuses(disk / "mlflow.db") == ["FINISHED"]


#: A plugin that fills the disk of the file ``KSPIPE_TEST_FILL`` names when the job first
#: logs metrics: the store's disk fills mid-run, at a known point.
FILLER = """
import contextlib
import os

from kspipe import hookimpl


def fill(path):
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(1 << 16))
            f.flush()


@hookimpl
def kspipe_log_metrics(metrics, step):
    path = os.environ["KSPIPE_TEST_FILL"]
    if not os.path.exists(path):
        fill(path)
"""


def test_a_tracking_store_whose_disk_fills_mid_run_says_so_once_and_the_run_folder_keeps_all(
    tmp_path, tiny_data
):
    """The store's disk fills at the run's first metrics: the job says once that the store
    cannot be written (not once per metric), trains on, keeps every result in its run
    folder, and ends in one line saying the run was not ended in the store."""
    package = tmp_path / "kspipe_filler"
    package.mkdir()
    (package / "__init__.py").write_text(FILLER)
    site = tmp_path / "site"
    install_plugin(site, package, "filler = kspipe_filler")
    with small_disk(tmp_path / "disk", 8 * 1024 * 1024) as disk:
        store = begun_store(disk)
        env = dict(plugin_env(site), KSPIPE_TEST_FILL=str(disk / "filler"))
        run = tmp_path / "run"
        result = job(
            tmp_path,
            tiny_data,
            run,
            f"tracking.uri={store}",
            "train.meta_iters=6",
            "eval.interval=1",
            env=env,
        )
    # the database or its artifacts (beside it, on the same disk) refuse first
    full = ("database or disk is full", "No space left on device")
    assert_one_line_error(
        result, f"tracking.uri={store}: ", "; the run was not ended there (it shows RUNNING)"
    )
    assert any(f"tracking.uri={store}: {reason}" in result.stderr for reason in full)
    assert result.returncode == 2
    said = [line for line in result.stderr.splitlines() if "cannot be written" in line]
    assert len(said) == 1, result.stderr
    assert any(
        said[0].startswith(f"kspipe: the MLflow store at {store} cannot be written ({reason}")
        for reason in full
    ), said
    assert said[0].endswith(
        "): the run's metrics and artifacts it refuses are not recorded "
        "there (its run folder holds them all)"
    ), said
    assert "did not record" not in result.stderr and "recorder stopped" not in result.stderr
    metrics = json.loads((run / "metrics.json").read_text())
    assert "test_accuracy" in metrics, metrics
    assert (run / "learning_curve.png").exists()
