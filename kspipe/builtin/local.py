"""Mode ``local``: one process is the only worker (stages ``role``, ``compile``, ``execute``)."""

from __future__ import annotations

from kspipe import hookimpl
from kspipe.errors import ConfigError
from kspipe.learner import ReptileLearner, train_and_evaluate
from kspipe.role import Role


@hookimpl
def kspipe_assign_role(cfg):
    return Role()


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    options = dict(cfg.compile.build_strategy or {})
    if options:
        programs.compiled_train = compile_with(programs.train, options)
    return programs


def compile_with(program, options: dict):
    """``program`` as a CompiledProgram with these BuildStrategy options set."""
    import paddle

    strategy = paddle.static.BuildStrategy()
    for name, value in options.items():
        if not hasattr(strategy, name):
            raise ConfigError(f"compile.build_strategy.{name}: Paddle's BuildStrategy has "
                              f"no such option")
        setattr(strategy, name, value)
    return paddle.static.CompiledProgram(program, build_strategy=strategy)


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    learner = ReptileLearner(cfg, dataset, programs, executor, scope, reporter, role)
    return train_and_evaluate(learner, reporter.run_dir)
