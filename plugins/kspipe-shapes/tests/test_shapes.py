"""The example plugin, tested with kspipe's test kit."""

import numpy as np
import pytest
from kspipe_shapes import plugin

from kspipe.api import ConfigError, HookRecorder, compose_config, plugin_manager, run_pipeline

CONFIG_DIRS = ["pkg://kspipe_shapes.conf"]


def shapes_cfg(tmp_path, *overrides):
    return compose_config(
        [
            "+experiment=shapes_5way",
            f"run_dir={tmp_path / 'run'}",
            "tracking.enabled=false",
            *overrides,
        ],
        config_dirs=CONFIG_DIRS,
    )


def test_drawings_of_a_shape_vary_but_resemble_each_other(tmp_path):
    cfg = shapes_cfg(tmp_path, "shapes.classes=10")
    dataset = plugin.kspipe_read_dataset(cfg=cfg, role=None)
    assert len(dataset.train) == 8 and len(dataset.test) == 2
    a = dataset.train[0].sample(4, np.random.default_rng(0))
    b = dataset.train[1].sample(4, np.random.default_rng(0))
    assert a.shape == (4, 28, 28, 1) and 0 <= a.min() and a.max() <= 1
    within = np.abs(a[0] - a[1]).mean()
    between = np.abs(a[0] - b[0]).mean()
    assert 0 < within and within < between * 1.5


def test_a_pipeline_runs_through_the_plugin(tmp_path):
    """A few meta-iterations, then 10 test tasks of 5 queries a shape: the model tells the
    shapes apart better than chance (1 in 5).  Seen on seeds 0-5: 0.32-0.39 (0.39 on this
    one); with the drawings dealt to the shapes at random (a data set whose classes mean
    nothing): 0.15-0.21."""
    recorder = HookRecorder()
    cfg = shapes_cfg(
        tmp_path,
        "train.meta_iters=4",
        "eval.tasks=10",
        "eval.queries=5",
        "eval.train_tasks=2",
        "eval.interval=2",
        "eval.interval_tasks=2",
        "shapes.classes=30",
    )
    assert cfg.stages.dataset == "shapes"
    metrics = run_pipeline(cfg, plugin_manager(("shapes", plugin), recorder))
    assert metrics["test_accuracy"] > 0.2 + 0.07, metrics
    assert "kspipe_run_end" in recorder.names()


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="shapes.classes=1"):
        run_pipeline(shapes_cfg(tmp_path, "shapes.classes=1"), plugin_manager(("shapes", plugin)))
