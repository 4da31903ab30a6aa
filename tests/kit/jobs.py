"""The suite's small jobs: the tiny job that schedulers and other launchers start, the small
ctr job and the AUC it must reach, and the weights a Reptile run's checkpoint holds."""

from __future__ import annotations

import pickle
from pathlib import Path

from kspipe.testing import begun_store, tiny_overrides

#: The tiny job of the tests of jobs others start (Paddle's launcher, Slurm, a PaddleJob):
#: parameter servers with sync exchanges, which repeat exactly.
SCHEDULED_JOB = ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=sync"]
#: Its collective form, given after :func:`scheduled_overrides` (whose servers and strategy
#: a collective job leaves unused).
SCHEDULED_COLLECTIVE = ["mode=collective", "workers=2"]


def scheduled_overrides(tmp_path: Path, data_root: Path) -> list[str]:
    """The tiny Reptile job of :data:`SCHEDULED_JOB`, without a run folder (the processes
    that a scheduler starts find theirs)."""
    return [
        "+experiment=omniglot_5way",
        *[o for o in tiny_overrides(tmp_path, data_root) if not o.startswith("run_dir=")],
        *SCHEDULED_JOB,
    ]


def latest_weights(run_dir: Path) -> dict:
    """The parameters in a run's latest checkpoint (the first worker's ``state.pdparams``)."""
    (path,) = sorted(Path(run_dir, "checkpoints").glob("checkpoint-*/state.pdparams"))[-1:]
    with open(path, "rb") as f:
        return pickle.load(f)


#: The small ctr job's files: lines a file (4 training files, 1 test file), and the test AUC
#: it must reach: the generated set's dense features alone score about 0.65, so only learnt
#: id embeddings get there (with 2,500 lines a file the model stayed near 0.70).
CTR_LINES = 5000
CTR_MIN_AUC = 0.72


def ctr_overrides(tmp_path: Path, *overrides) -> list[str]:
    """The small ctr job (``+experiment=ctr_datafeed``, 3 epochs of generated files cached
    under ``tmp_path``), writing into ``tmp_path/run`` and the MLflow store
    ``tmp_path/mlflow.db`` (:func:`kspipe.testing.begun_store`); ``overrides`` last."""
    return [
        "+experiment=ctr_datafeed",
        f"run_dir={tmp_path / 'run'}",
        f"tracking.uri={begun_store(tmp_path)}",
        f"datafeed.generated.cache_dir={tmp_path / 'cache'}",
        "datafeed.generated.train_files=4",
        "datafeed.generated.test_files=1",
        f"datafeed.generated.lines_per_file={CTR_LINES}",
        "ctr.epochs=3",
        "datafeed.print_period_s=0.2",
        *overrides,
    ]
