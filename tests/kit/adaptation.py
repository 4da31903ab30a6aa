"""What a Reptile run's served model must answer: a test task of the run's data set, and the
answer kspipe's own adaptation gives it."""

from __future__ import annotations

from pathlib import Path


def a_test_task(run_dir: Path):
    """A test task of a Reptile run's data set (two queries per class), the data set and
    the run's config (as its inference model holds it)."""
    import numpy as np
    from omegaconf import OmegaConf

    from kspipe.fewshot import plugin as open_ks
    from kspipe.fewshot.data import sample_task
    from kspipe.modes.role import Role

    cfg = OmegaConf.load(run_dir / "inference_model" / "kspipe_config.yaml")
    dataset = open_ks.kspipe_read_dataset(cfg=cfg, role=Role())
    task = sample_task(dataset.test, cfg.task.ways, cfg.task.shots, 2, np.random.default_rng(7))
    return task, dataset, cfg


def cpu_learner(cfg, dataset, programs=None, reporter=None, role=None):
    """A Reptile learner of ``cfg`` on the CPU with a scope of its own, initialised; its
    programs built by the reptile workload's own hooks unless ``programs`` are given."""
    import paddle

    from kspipe.modes.role import Role
    from kspipe.reptile import plugin as reptile
    from kspipe.reptile.learner import ReptileLearner

    paddle.enable_static()
    if programs is None:
        programs = reptile.kspipe_build_program(cfg=cfg, dataset=dataset, role=Role())
        programs = reptile.kspipe_compile_program(cfg=cfg, role=Role(), programs=programs)
    executor, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    learner = ReptileLearner(cfg, dataset, programs, executor, scope, reporter, role)
    learner.initialize()
    return learner


def reference_adaptation(run_dir: Path, task, dataset, seed: int):
    """kspipe's own adaptation of ``task`` from a Reptile run's final model, as its
    evaluation of the run (``evaluate=<run>``) does it: the logits of the queries."""
    import numpy as np
    from omegaconf import OmegaConf

    from kspipe.reptile.tasks import nchw

    cfg = OmegaConf.load(run_dir / "inference_model" / "kspipe_config.yaml")
    learner = cpu_learner(cfg, dataset)
    learner.load_checkpoint(str(run_dir), "evaluate")
    learner.adapt(
        nchw(task.support_x),
        task.support_y,
        cfg.eval.inner_batch,
        cfg.eval.inner_iters,
        np.random.default_rng(seed),
    )
    return learner.query_logits(nchw(task.support_x), nchw(task.query_x))
