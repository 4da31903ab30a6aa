"""Every shipped experiment composes and runs (shrunk to seconds), as a user would start it."""

from importlib import resources

import numpy as np
import pytest
from PIL import Image

from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager, tiny_overrides

EXPERIMENTS = sorted(f.name[:-5] for f in resources.files("kspipe.conf").joinpath("experiment")
                     .iterdir() if f.name.endswith(".yaml"))


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
    assert {"omniglot_5way", "omniglot_5way_paper", "omniglot_5way_1shot", "omniglot_20way",
            "omniglot_20way_1shot", "miniimagenet_5way", "miniimagenet_5way_1shot"} <= set(EXPERIMENTS)
    paper = compose_config(["+experiment=omniglot_20way_1shot"])
    assert (paper.task.ways, paper.task.shots, paper.train.inner_iters, paper.train.inner_lr) == (
        20, 1, 10, 0.0005)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_runs(experiment, tmp_path, tiny_data, tiny_imagenet):
    if experiment.startswith("ctr"):  # MultiSlot files: the generated set, shrunk
        from kspipe.ctr.training import _process_threads  # one count per process (Paddle)

        cfg = compose_config([f"+experiment={experiment}", f"run_dir={tmp_path}/run",
                              "tracking.enabled=false", "datafeed.generated.lines_per_file=200",
                              f"datafeed.generated.cache_dir={tmp_path}/cache", "ctr.epochs=1",
                              f"datafeed.threads={_process_threads or 2}"])
        metrics = run(cfg, plugin_manager())
        assert 0.0 <= metrics["test_auc"] <= 1.0 and metrics["test_instances"] == 400
        return
    data = tiny_imagenet if experiment.startswith("miniimagenet") else tiny_data
    cfg = compose_config([f"+experiment={experiment}", *tiny_overrides(tmp_path, data),
                          "eval.inner_batch=3"])
    metrics = run(cfg, plugin_manager())
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
