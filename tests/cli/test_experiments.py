"""Every shipped experiment composes and runs (shrunk to seconds), as a user would start it."""

import sqlite3
import subprocess
import sys
from importlib import resources

import numpy as np
import pytest
from PIL import Image

from kspipe.testing import compose_config, tiny_overrides

#: The experiments that read data of their own layout, run by their own tests: ctr_stream
#: trains over a stream's day folders (tests/workloads/test_ctr_stream.py).
OWN_DATA = {"ctr_stream"}
EXPERIMENTS = sorted(
    f.name[:-5]
    for f in resources.files("kspipe.conf").joinpath("experiment").iterdir()
    if f.name.endswith(".yaml") and f.name[:-5] not in OWN_DATA
)


@pytest.fixture(scope="module")
def tiny_imagenet(tmp_path_factory):
    """Split-folder RGB classes: each class a colour, with noise."""
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    for split, count in (("train", 6), ("val", 3), ("test", 6)):
        for c in range(count):
            folder = root / split / f"n{split}{c:03d}"
            folder.mkdir(parents=True)
            colour = rng.integers(0, 256, 3)
            for i in range(4):
                pixels = np.clip(colour + rng.normal(0, 30, (90, 90, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.JPEG")
    return root


def test_the_paper_settings_are_all_there():
    assert {
        "omniglot_5way",
        "omniglot_5way_paper",
        "omniglot_5way_1shot",
        "omniglot_20way",
        "omniglot_20way_1shot",
        "miniimagenet_5way",
        "miniimagenet_5way_1shot",
    } <= set(EXPERIMENTS)
    paper = compose_config(["+experiment=omniglot_20way_1shot"])
    assert (paper.task.ways, paper.task.shots, paper.train.inner_iters, paper.train.inner_lr) == (
        20,
        1,
        10,
        0.0005,
    )


def test_every_experiment_runs_in_one_multirun(tmp_path, tiny_imagenet):
    """``kspipe -m +experiment=<all of them>``, shrunk to a few meta-iterations, on one small
    split-folder set (mini-ImageNet's layout; the Omniglot experiments read it too) and the
    generated click-through files.  The jobs share the sweep's process (``isolate=false``,
    half the time: a process's start-up is most of a shrunk job's); a sweep's jobs each in
    a process of their own, ctr's too, are test_sweeps.py's."""
    reptile = [o for o in tiny_overrides(tmp_path, tiny_imagenet) if not o.startswith("run_dir=")]
    ctr = [
        "datafeed.generated.lines_per_file=200",
        f"datafeed.generated.cache_dir={tmp_path}/cache",
        "ctr.epochs=1",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "-m",
            f"+experiment={','.join(EXPERIMENTS)}",
            *reptile,
            "eval.inner_batch=3",
            *ctr,
            "isolate=false",
            f"hydra.sweep.dir={tmp_path}/multirun",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        rows = db.execute("select name, status from runs").fetchall()
    assert len(rows) == len(EXPERIMENTS) + 1  # the sweep's parent run and one run per job
    assert {status for _, status in rows} == {"FINISHED"}, rows
    assert not (tmp_path / "outputs").exists()  # every job wrote under the sweep's folder
