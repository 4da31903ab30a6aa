"""Checkpoints by wall-clock time in a cluster: every worker of a sync parameter-server job
checkpoints after the same rounds (their clocks do not decide alone), and the job resumed
from such a checkpoint ends bit for bit as the uninterrupted one."""

import pickle
from pathlib import Path

import numpy as np

from kspipe.testing import run_kspipe
from tests.kit import scheduled_overrides

#: 60 microseconds: every round takes longer, so each one ends a window
TIMED = [
    "train.meta_iters=8",
    "train.checkpoint_every=0",
    "train.checkpoint_minutes=0.000001",
    "train.keep_checkpoints=10",
    "eval.interval=0",
    "eval.baseline=false",
]


def steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*"))


def state(folder: Path, step: int) -> dict:
    arrays = {}
    for suffix in (".pdparams", ".pdopt"):
        path = folder / f"checkpoint-{step:07d}" / f"state{suffix}"
        arrays.update(pickle.loads(path.read_bytes()))
    return arrays


def test_sync_workers_checkpoint_by_time_after_the_same_rounds_and_resume_exactly(
    tmp_path, tiny_data
):
    common = [*scheduled_overrides(tmp_path, tiny_data), *TIMED]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = run_kspipe(*common, f"run_dir={whole}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    first, other = whole / "checkpoints", whole / "checkpoints" / "worker-1"
    assert steps(first) == steps(other) == [2, 4, 6, 8]  # a round is 2 meta-iterations

    point = first / "checkpoint-0000004"
    result = run_kspipe(*common, f"run_dir={resumed}", f"resume={point}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from meta-iteration 4 " in result.stderr
    for folder in ("checkpoints", "checkpoints/worker-1"):
        expected, got = state(whole / folder, 8), state(resumed / folder, 8)
        assert sorted(expected) == sorted(got)
        for name in expected:
            np.testing.assert_array_equal(expected[name], got[name], err_msg=f"{folder} {name}")
