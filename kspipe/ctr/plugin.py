"""The ``ctr`` workload: a click-through-rate model trained from MultiSlot files.

Stages ``program``, ``compile``, ``execute`` and ``save`` of ``+experiment=ctr_datafeed``
(its data set is the ``datafeed`` plugin's).  The same code runs in every mode that can
give what it needs (:data:`NEEDS`): its tables are made with ``role.embedding`` (on the
servers in ``mode=pserver``: ``sparse_embedding``, rows created as ids are seen) and its
optimiser is ``role.distributed_optimizer(..., feeding="dataset")``.  At the end the
first worker evaluates on the held-out files and pulls every table row (from wherever the
mode keeps them) into one scope, so the exported model is self-contained in every mode.
"""

from __future__ import annotations

from kspipe import hookimpl
from kspipe.checkpoint.incremental import start_from
from kspipe.contracts import Workload
from kspipe.ctr.config import CtrConfig
from kspipe.ctr.evaluation import evaluate, pull_tables
from kspipe.ctr.model import build, fetch_vars
from kspipe.ctr.stream import loop as stream
from kspipe.ctr.stream.saves import with_delta_threshold
from kspipe.ctr.tables import check_tables, report_collisions, server_tables
from kspipe.ctr.training import train
from kspipe.errors import ConfigError, check_integer, check_keys, check_number

#: What the ctr workload needs of its mode.
NEEDS = frozenset({"dataset_training", "sparse_tables"})


@hookimpl
def kspipe_config_schemas():
    return {"ctr": CtrConfig}


@hookimpl
def kspipe_describe_workload(cfg):
    return Workload(
        name="ctr",
        headline="test_auc",
        rate="samples_per_s",
        summary=("test_auc", "train_auc", "samples_per_s"),
        needs=NEEDS,
        serving="kspipe.ctr.serving:ClickModel",
        starts_from=True,
        resumes=True,
    )


@hookimpl
def kspipe_check_config(cfg):
    if cfg.stages.program != "ctr":
        return
    check_keys(
        cfg,
        {
            "ctr.embedding_dim": 1,
            "ctr.hash_size": 1,
            "ctr.epochs": 0,
            "datafeed.print_period": 1,
            "train.keep_checkpoints": 1,
        },
    )
    for i, size in enumerate(cfg.ctr.hidden):
        check_integer(size, f"ctr.hidden[{i}]", 1)
    check_number(cfg.ctr.learning_rate, "ctr.learning_rate", 0, above=True)
    check_tables(cfg)
    check_number(cfg.datafeed.print_period_s, "datafeed.print_period_s", 0, above=True)
    if cfg.ctr.stream.root is not None:
        check_stream(cfg)
    if cfg.train.checkpoint_minutes is not None:  # checked, though an epoch is ctr's unit
        check_number(cfg.train.checkpoint_minutes, "train.checkpoint_minutes", 0, above=True)


def check_stream(cfg) -> None:
    from kspipe.ctr.stream import layout, saves

    if cfg.mode != "pserver":
        raise ConfigError(
            f"ctr.stream needs mode=pserver (mode={cfg.mode}): its saves are the parameter "
            f"servers' base and delta tables"
        )
    layout.check(cfg.ctr.stream)
    saves.check_exact(cfg)
    if cfg.resume:  # a save cut short: the last whole one (the command says so, once)
        from omegaconf import open_dict

        from kspipe.files import user_path
        from kspipe.reporting import say

        with open_dict(cfg):
            cfg.resume = saves.intact(user_path(cfg.resume), say)


@hookimpl
def kspipe_build_program(cfg, dataset, role):
    return build(cfg, dataset, role)


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    import paddle

    optimizer = paddle.optimizer.Adam(programs.learning_rate, lazy_mode=True)
    with (
        paddle.utils.unique_name.guard(),
        paddle.static.program_guard(programs.main, programs.startup),
    ):
        tables = server_tables(cfg, sorted(programs.tables))
        if cfg.ctr.stream.root is not None:
            tables = with_delta_threshold(tables)
        tables = {"tables": tables}
        role.distributed_optimizer(optimizer, tables, feeding="dataset").minimize(programs.loss)
        programs.main = programs.loss.block.program  # as the mode rewrote it
        programs.startup = paddle.static.default_startup_program()
    programs.test = programs.main.clone(for_test=True)._prune([programs.pred])
    programs.fetch = fetch_vars(programs, list(cfg.datafeed.fetch or []))
    return programs


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    import paddle

    with paddle.static.scope_guard(scope):
        executor.run(programs.startup)
    if cfg.ctr.ids == "raw" and not programs.raw_ids:  # ids hashed here, kept raw on servers
        report_collisions(dataset, cfg.ctr.hash_size, reporter)
    start = start_from(cfg, programs.main, scope, reporter.run_dir, reporter)
    role.init_worker(scope)
    start.load_tables(role)
    if cfg.ctr.stream.root is not None:
        metrics = stream.run(cfg, role, dataset, programs, executor, scope, reporter)
        programs.stream_save = stream.last_save(reporter.run_dir)  # the model serves it
    else:
        metrics = train(cfg, role, dataset, programs, executor, scope, reporter)
    role.finish_training(scope)
    if role.is_first_worker():
        if dataset.test_files:
            metrics.update(evaluate(dataset, programs, executor, scope, reporter))
        programs.export_scope = pull_tables(cfg, programs, executor, scope, role, reporter.run_dir)
        reporter.metrics(metrics, step=metrics["train_instances"])
    return metrics


@hookimpl
def kspipe_save_inference_model(cfg, role, programs, executor, scope, dirname):
    from kspipe.inference import export

    prefix = export(
        cfg,
        dirname,
        programs.infer,
        programs.infer_feeds,
        [programs.infer_pred],
        executor,
        programs.export_scope or scope,
    )
    if programs.stream_save:  # which save the model serves, for kspipe ctr refresh
        from kspipe.ctr.stream.refresh import mark

        mark(dirname, programs.stream_save)
    return prefix
