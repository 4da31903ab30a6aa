"""``resume=`` at another size: a Reptile job and one of the tests' workload (bags, Adam)
checkpointed on 2 workers and 1 server go on on 3 workers and 2 servers exactly as a job
of that size resumed from the same state, and a size the workload cannot split its work
among (a checkpoint mid-round, a batch that does not divide) is one line.

The reference is the same-size resume, which repeats an uninterrupted run exactly
(tests/modes/test_preemption.py): the checkpoint laid out as a 3-worker job's would be,
each new worker with the first worker's optimiser state (what a resized job gives it)."""

import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from kspipe.testing import assert_one_line_error, run_kspipe, run_statuses
from tests.kit import scheduled_overrides

#: The saved job's 6 meta-iterations (3 rounds of 2), then 12 in all: 2 rounds of 3 more.
SAVED, ITERATIONS = 6, 12
LONGER = [f"train.meta_iters={ITERATIONS}", "eval.interval=0", "eval.baseline=false"]
SAVED_ON = ["workers=2", "servers=1"]
RESIZED = ["workers=3", "servers=2"]


def reptile(tmp_path: Path, data: Path, name: str, *overrides, ok: bool = True):
    """The tiny sync Reptile job (``scheduled_overrides``) run in ``tmp_path/name``."""
    result = run_kspipe(
        *scheduled_overrides(tmp_path, data),
        *LONGER,
        *overrides,
        f"run_dir={tmp_path / name}",
        cwd=tmp_path,
    )
    if ok:
        assert result.returncode == 0, (name, result.stderr[-3000:])
    return result


def state(checkpoint: Path) -> dict:
    """Every array a checkpoint's state holds: parameters and optimiser state."""
    arrays = {}
    for suffix in (".pdparams", ".pdopt"):
        with open(checkpoint / f"state{suffix}", "rb") as f:
            arrays.update(pickle.load(f))
    return arrays


def as_written_by(checkpoint: Path, target: Path, workers: int, servers: int) -> None:
    """``checkpoint`` (and its workers' own states) copied into ``target``, each worker it
    lacks given the first worker's state, every config saying ``workers`` and ``servers``."""
    saved = checkpoint.parent
    copies = [(checkpoint, target / checkpoint.name)]
    for w in range(1, workers):
        own = saved / f"worker-{w}" / checkpoint.name
        copies.append((own if own.is_dir() else checkpoint, target / f"worker-{w}" / own.name))
    for source, copy in copies:
        shutil.copytree(source, copy)
        config = copy / "config.yaml"
        text = re.sub(r"(?m)^workers: .*$", f"workers: {workers}", config.read_text())
        config.write_text(re.sub(r"(?m)^servers: .*$", f"servers: {servers}", text))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_data):
    """The job run for ``SAVED`` meta-iterations on 2 workers and 1 server: its folder
    (beside its MLflow store) and its last checkpoint."""
    tmp = tmp_path_factory.mktemp("saved")
    reptile(tmp, tiny_data, "saved", *SAVED_ON, f"train.meta_iters={SAVED}")
    return tmp, tmp / "saved" / "checkpoints" / f"checkpoint-{SAVED:07d}"


def assert_same(got: dict, expected: dict, who: str) -> None:
    assert set(got) == set(expected), who
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{who}: {name}")


def test_reptile_resumes_on_more_workers_and_servers_as_a_job_of_that_size(
    saved, tmp_path, tiny_data
):
    _, cut = saved
    resized = reptile(tmp_path, tiny_data, "resized", *RESIZED, f"resume={cut}")
    line = f"resumes {cut.name} of 2 workers and 1 server on 3 workers and 2 servers"
    assert f"kspipe: {line}\n" in resized.stderr, resized.stderr[-3000:]
    assert "re-sharded" not in resized.stderr  # the exchange's table is the workers' model

    laid_out = tmp_path / "laid-out" / "checkpoints"
    as_written_by(cut, laid_out, 3, 2)
    same = reptile(tmp_path, tiny_data, "same", *RESIZED, f"resume={laid_out / cut.name}")
    assert "kspipe: resumes" not in same.stderr
    for w, folder in enumerate(("", "worker-1", "worker-2")):
        end = Path(folder, f"checkpoint-{ITERATIONS:07d}")
        got = state(tmp_path / "resized" / "checkpoints" / end)
        expected = state(tmp_path / "same" / "checkpoints" / end)
        assert_same(got, expected, f"worker {w}")
    # it trained from the checkpoint on: its model is not the saved one
    ended = state(tmp_path / "resized" / "checkpoints" / f"checkpoint-{ITERATIONS:07d}")
    assert any(not np.array_equal(ended[n], v) for n, v in state(cut).items())


def test_a_checkpoint_the_new_workers_cannot_split_is_one_line(saved, tiny_data):
    """4 workers run rounds of 4 meta-iterations from 0: the checkpoint at meta-iteration
    6 (of 2 workers) falls mid-round, refused before anything starts."""
    tmp, _ = saved
    result = reptile(tmp, tiny_data, "again", "workers=4", f"resume={tmp / 'saved'}", ok=False)
    assert_one_line_error(result, f"checkpoint-{SAVED:07d} ends meta-iteration {SAVED}")
    assert "4 workers run rounds of 4" in result.stderr
    assert run_statuses(tmp / "mlflow.db") == ["FINISHED"]  # the saved run's alone
    assert not (tmp / "again" / "logs").exists()


#: The tests' workload on the servers, sync, with Adam (each worker's moments its own), a
#: global batch of 48 (2 and 3 workers take slices of 24 and 16) and a checkpoint every
#: 2 epochs of 10 batches.
BAGS = [
    "+experiment=bags",
    "tracking.enabled=false",
    "mode=pserver",
    "cluster.strategy=sync",
    "bags.optimizer=adam",
    "bags.learning_rate=0.05",
    "bags.batch_size=48",
    "bags.train_points=480",
    "bags.test_points=96",
    "bags.checkpoint_every=2",
]


def bags(env: dict, tmp_path: Path, name: str, *overrides, ok: bool = True):
    result = run_kspipe(*BAGS, *overrides, f"run_dir={tmp_path / name}", cwd=tmp_path, env=env)
    if ok:
        assert result.returncode == 0, (name, result.stderr[-3000:])
    return result


def test_bags_resumes_with_adam_on_more_workers_and_servers_as_a_job_of_that_size(
    bags_env, tmp_path
):
    bags(bags_env, tmp_path, "saved", *SAVED_ON, "bags.epochs=2")
    cut = tmp_path / "saved" / "checkpoints" / "checkpoint-0000002"
    assert (tmp_path / "saved" / "checkpoints" / "worker-1" / cut.name).is_dir()
    resized = bags(bags_env, tmp_path, "resized", *RESIZED, "bags.epochs=4", f"resume={cut}")
    line = f"resumes {cut.name} of 2 workers and 1 server on 3 workers and 2 servers"
    assert f"kspipe: {line}\n" in resized.stderr, resized.stderr[-3000:]

    laid_out = tmp_path / "laid-out" / "checkpoints"
    as_written_by(cut, laid_out, 3, 2)
    same = bags(
        bags_env, tmp_path, "same", *RESIZED, "bags.epochs=4", f"resume={laid_out / cut.name}"
    )
    assert "kspipe: resumes" not in same.stderr
    for w, folder in enumerate(("", "worker-1", "worker-2")):
        end = Path(folder, "checkpoint-0000004")
        got = state(tmp_path / "resized" / "checkpoints" / end)
        assert any(n.endswith("moment1_0") for n in got)  # Adam's, each worker's own
        assert_same(got, state(tmp_path / "same" / "checkpoints" / end), f"worker {w}")
    assert_same(
        dict(np.load(tmp_path / "resized" / "params.npz")),
        dict(np.load(tmp_path / "same" / "params.npz")),
        "the final model",
    )
    # the workers' moments differ (each its own slices): the state was not one worker's
    ends = [
        state(tmp_path / "resized" / "checkpoints" / f / "checkpoint-0000004")
        for f in ("", "worker-2")
    ]
    moments = [n for n in ends[0] if n.endswith("moment1_0")]
    assert any(not np.array_equal(ends[0][n], ends[1][n]) for n in moments)

    result = bags(bags_env, tmp_path, "again", "workers=5", f"resume={cut}", ok=False)
    assert_one_line_error(result, "bags.batch_size=48 does not divide among 5 workers")
