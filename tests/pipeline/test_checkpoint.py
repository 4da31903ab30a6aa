"""Checkpoints describe themselves: each folder holds the resolved config that produced it."""

import os

from omegaconf import OmegaConf

from kspipe import checkpoint
from kspipe.testing import compose_config


def test_a_checkpoint_folder_holds_the_resolved_config_of_its_run(tmp_path):
    import paddle

    from kspipe.reptile.learner import ReptileLearner
    from kspipe.reptile.programs import build_programs

    paddle.enable_static()
    cfg = compose_config(["model.filters=8", "task.ways=3", "seed=7", "train.keep_checkpoints=1",
                          f"run_dir={tmp_path / 'run'}"])
    programs = build_programs((28, 28, 1), 3, cfg.model, 0.01, seed=0)
    learner = ReptileLearner(cfg, None, programs, paddle.static.Executor(paddle.CPUPlace()),
                             paddle.static.Scope(), reporter=None)
    learner.initialize()
    folder = tmp_path / "run" / "checkpoints"
    learner.save_checkpoint(str(folder), 1)
    path = learner.save_checkpoint(str(folder), 2)

    assert os.listdir(folder) == ["checkpoint-0000002"]  # written whole, the older one gone
    saved = OmegaConf.load(os.path.join(path, "config.yaml"))
    assert saved.seed == 7 and saved.task.ways == 3 and saved.run_dir == str(tmp_path / "run")
    assert saved.stages.compile == "reptile"  # resolved: no ${...} left
    assert checkpoint.latest(str(tmp_path / "run")) == path
