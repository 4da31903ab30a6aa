"""Checkpoints describe themselves: each folder holds the resolved config that produced it.
A write that stops halfway (an error, a stop request) leaves nothing half-written, and a
launcher removes what a killed process left."""

import os

import pytest
from omegaconf import OmegaConf

from kspipe import checkpoint
from kspipe.testing import compose_config
from tests.kit.adaptation import cpu_learner


def small_learner(tmp_path):
    import paddle

    from kspipe.reptile.programs import build_programs

    paddle.enable_static()
    cfg = compose_config(
        [
            "model.filters=8",
            "task.ways=3",
            "seed=7",
            "train.keep_checkpoints=1",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    programs = build_programs((28, 28, 1), 3, cfg.model, 0.01, seed=0)
    return cpu_learner(cfg, None, programs)


def test_a_checkpoint_folder_holds_the_resolved_config_of_its_run(tmp_path):
    learner = small_learner(tmp_path)
    folder = tmp_path / "run" / "checkpoints"
    learner.save_checkpoint(str(folder), 1)
    path = learner.save_checkpoint(str(folder), 2)
    learner.writer.wait()  # the first worker's files are written on the writer's thread

    assert os.listdir(folder) == ["checkpoint-0000002"]  # written whole, the older one gone
    saved = OmegaConf.load(os.path.join(path, "config.yaml"))
    assert saved.seed == 7 and saved.task.ways == 3 and saved.run_dir == str(tmp_path / "run")
    assert saved.stages.compile == "reptile"  # resolved: no ${...} left
    assert checkpoint.latest(str(tmp_path / "run")) == path


def test_a_write_that_stops_halfway_leaves_the_last_checkpoint_alone(tmp_path):
    learner = small_learner(tmp_path)
    folder = tmp_path / "run" / "checkpoints"
    learner.save_checkpoint(str(folder), 1)
    learner.writer.wait()

    def interrupted(path):  # the servers' tables, when the stop request comes
        os.makedirs(path)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(
            learner.p.train, learner.scope, str(folder), 2, {}, 3, learner.cfg, tables=interrupted
        )
    assert os.listdir(folder) == ["checkpoint-0000001"]


def test_a_launcher_discards_the_checkpoints_its_killed_processes_were_writing(tmp_path):
    for path in [
        "checkpoints/checkpoint-0000004/state.pdparams",
        "checkpoints/checkpoint-0000008.tmp/state.pdparams",
        "checkpoints/worker-1/checkpoint-0000008.tmp/progress.json",
        "logs/worker.0.log",
    ]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    checkpoint.discard_unfinished(str(tmp_path))
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["checkpoints/checkpoint-0000004/state.pdparams", "logs/worker.0.log"]


def test_every_keep_value_leaves_a_whole_checkpoint_to_resume_from(tmp_path):
    """keep_checkpoints=1: a worker's own part of checkpoint n is written before the first
    worker's checkpoint n, whose files are still on their way on its thread; the worker's
    part of checkpoint n-1 stays until checkpoint n is complete, so a kill in between
    resumes n-1 with every worker's own state."""
    learner = small_learner(tmp_path)
    folder = tmp_path / "run" / "checkpoints"
    part = folder / "worker-1"

    def save(where, step, follows=None):
        return checkpoint.save(
            learner.p.train,
            learner.scope,
            str(where),
            step,
            {"step": step},
            1,
            learner.cfg,
            follows=follows,
        )

    save(part, 1, follows=str(folder))
    save(folder, 1)
    save(part, 2, follows=str(folder))  # checkpoint 2 itself is not complete yet
    assert sorted(os.listdir(part)) == ["checkpoint-0000001", "checkpoint-0000002"]
    assert checkpoint.latest(str(folder)).endswith("checkpoint-0000001")
    save(folder, 2)  # complete: checkpoint 1 goes, with every worker's part of it
    assert sorted(os.listdir(folder)) == ["checkpoint-0000002", "worker-1"]
    assert os.listdir(part) == ["checkpoint-0000002"]
    save(part, 3, follows=str(folder))
    assert sorted(os.listdir(part)) == ["checkpoint-0000002", "checkpoint-0000003"]
