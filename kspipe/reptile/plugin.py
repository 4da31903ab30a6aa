"""The ``reptile`` workload: stages ``program``, ``compile``, ``execute`` and ``save``.

The same code runs in every mode: the compile stage asks the role for a
``parameter_sync`` of the model's parameters, and each meta-iteration's local meta step
is followed by its ``step()`` (nothing locally; the strategy's exchange with parameter
servers; the mean over collective workers).  Worker w of W runs the global
meta-iterations w, w+W, ..., so a cluster sees the tasks of a local run of that length.
"""

from __future__ import annotations

import functools
import os

from kspipe import checkpoint, hookimpl
from kspipe.checkpoint.resizing import resumed, size
from kspipe.compiling import build_options, compile_options, compile_with, use_onednn
from kspipe.contracts import Workload
from kspipe.errors import ConfigError, check_integer, check_keys, check_number
from kspipe.reptile.batched import build_batched_programs, use_onednn_relu
from kspipe.reptile.config import EvalConfig, ModelConfig, TaskConfig, TrainConfig
from kspipe.reptile.lanes import program_sizes, train_sizes
from kspipe.reptile.learner import ReptileLearner
from kspipe.reptile.programs import ALGORITHMS, INNER_OPTIMIZERS, build_programs
from kspipe.reptile.training import train_and_evaluate


def check_resumed_size(cfg) -> None:
    """A checkpoint resumed on another number of workers must end a round of theirs.

    Worker w of W runs the meta-iterations w, w+W, ... in rounds of W (a sync exchange
    is a round that every worker joins, and the meta step anneals by rounds), so W
    workers go on from a meta-iteration that is a multiple of W: each of them then has
    its share of every round, as in a job that had run at that size all along."""
    found = resumed(cfg)
    if found is None or found[1][0] == size(cfg)[0]:
        return
    path, workers = found[0], size(cfg)[0]
    done = checkpoint.read_progress(path, f"resume={cfg.resume}").get("meta_iteration", 0)
    if done % workers:
        raise ConfigError(
            f"resume={cfg.resume}: {os.path.basename(path)} ends meta-iteration {done}, "
            f"and {workers} workers run rounds of {workers} meta-iterations from 0: "
            f"resume it on a number of workers that divides {done}, or resume "
            f"another checkpoint"
        )


@hookimpl
def kspipe_config_schemas():
    return {"task": TaskConfig, "model": ModelConfig, "train": TrainConfig, "eval": EvalConfig}


@hookimpl
def kspipe_describe_workload(cfg):
    return Workload(
        name="reptile",
        headline="test_accuracy",
        rate="tasks_per_s",
        summary=("test_accuracy", "baseline_test_accuracy", "train_accuracy", "tasks_per_s"),
        serving="kspipe.reptile.serving:FewShotModel",
        starts_from=True,
        resumes=True,
        # the workers take turns at the meta-iterations (0: not known without a config)
        steps=cfg.train.meta_iters if cfg is not None else 0,
        steps_key="train.meta_iters",
    )


@hookimpl
def kspipe_check_config(cfg):
    if cfg.stages.program != "reptile":
        return
    check_keys(
        cfg,
        {
            "task.ways": 1,
            "task.shots": 1,
            "train.meta_iters": 0,
            "train.meta_batch": 1,
            "train.inner_iters": 0,
            "train.inner_batch": 1,
            "train.shots": 1,
            "eval.tasks": 1,
            "eval.train_tasks": 1,
            "eval.queries": 1,
            "eval.inner_iters": 0,
            "eval.inner_batch": 1,
            "eval.interval": 0,
            "eval.interval_tasks": 1,
            "eval.batch_tasks": 1,
            "eval.threads": 0,
            "train.threads": 0,
            "train.checkpoint_every": 0,
            "train.keep_checkpoints": 1,
        },
        numbers=("train.inner_lr", "train.meta_step", "train.meta_step_final"),
    )
    for key, allowed in (("inner_optimizer", INNER_OPTIMIZERS), ("algorithm", ALGORITHMS)):
        if cfg.train[key] not in allowed:
            raise ConfigError(f"train.{key}={cfg.train[key]!r} is not one of {', '.join(allowed)}")
    check_number(cfg.train.weight_decay, "train.weight_decay", 0, above=True)
    if cfg.train.checkpoint_minutes is not None:
        check_number(cfg.train.checkpoint_minutes, "train.checkpoint_minutes", 0, above=True)
    if cfg.get("evaluate") and (cfg.mode != "local" or cfg.resume):
        raise ConfigError(
            "evaluate=<run or checkpoint> evaluates in one process: it takes "
            "mode=local and no resume"
        )
    check_resumed_size(cfg)
    tail = cfg.train.foml_tail
    if tail is not None:
        check_integer(tail, "train.foml_tail", 1)
        if cfg.train.algorithm != "foml":
            raise ConfigError("train.foml_tail is for train.algorithm=foml")
        if tail >= cfg.train.shots:
            raise ConfigError(
                f"train.foml_tail={tail} leaves no images of the "
                f"train.shots={cfg.train.shots} per class for the other steps"
            )
    if cfg.train.replacement:  # a batch draws distinct images of one task
        for key, shots in (("train", cfg.train.shots), ("eval", cfg.task.shots)):
            if cfg[key].inner_batch > shots * cfg.task.ways:
                raise ConfigError(
                    f"train.replacement: {key}.inner_batch={cfg[key].inner_batch} "
                    f"is more than the {shots * cfg.task.ways} images of a task"
                )


@hookimpl
def kspipe_build_program(cfg, dataset, role):
    options = dict(
        image_shape=dataset.image_shape,
        ways=cfg.task.ways,
        model=cfg.model,
        inner_lr=cfg.train.inner_lr,
        inner_optimizer=cfg.train.inner_optimizer,
        weight_decay=cfg.train.weight_decay,
    )
    programs = build_programs(seed=cfg.seed, **options)
    for tasks in program_sizes(cfg):
        if tasks in train_sizes(cfg):
            programs.batched[tasks] = build_batched_programs(programs, tasks, **options)
        else:  # evaluation's, built at the first evaluation: not in the job's start-up
            programs.later[tasks] = functools.partial(
                build_batched_programs, programs, tasks, **options
            )
    return programs


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    import paddle

    on_cpu = isinstance(role.place(), paddle.CPUPlace)
    programs.compiled_train = compile_options(cfg, programs.train, programs.forward, on_cpu=on_cpu)
    options = build_options(cfg)

    def compiled(together):  # what trains side by side, built alike
        if cfg.compile.onednn_conv and on_cpu:
            use_onednn(together.train, together.forward)
            use_onednn_relu(together.train, together.forward)
        together.compile = functools.partial(compile_with, options=options) if options else None
        return together

    for together in programs.batched.values():
        compiled(together)
    for tasks, make in programs.later.items():
        programs.later[tasks] = lambda make=make: compiled(make())
    block = programs.train.global_block()
    programs.sync = role.parameter_sync({n: list(block.var(n).shape) for n in programs.params})
    return programs


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    learner = ReptileLearner(cfg, dataset, programs, executor, scope, reporter, role)
    try:
        return train_and_evaluate(learner)
    finally:
        learner.close()


@hookimpl
def kspipe_save_inference_model(cfg, role, programs, executor, scope, dirname):
    from kspipe.inference import export

    return export(
        cfg, dirname, programs.infer, [programs.infer_x], [programs.infer_logits], executor, scope
    )
