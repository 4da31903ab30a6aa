"""Mode ``local``: one process is the only worker (stages ``role``, ``compile``, ``execute``).

With ``isolate`` (the default in a sweep) the command starts that process as a child of
its own and watches it, so nothing a job leaves in its Paddle process (the dataset
trainer's thread pool, global flags, math threads) reaches the sweep's next job.
"""

from __future__ import annotations

import os

from kspipe import hookimpl
from kspipe.errors import ConfigError
from kspipe.learner import ReptileLearner, train_and_evaluate
from kspipe.role import Role


@hookimpl
def kspipe_assign_role(cfg):
    if cfg.get("isolate"):
        return IsolatedLauncher(cfg)
    return Role()


class IsolatedLauncher(Role):
    """Runs the local job in one child process (``python -m kspipe.worker``)."""

    is_launcher = True

    def __init__(self, cfg):
        self.cfg = cfg

    def launch(self, reporter) -> dict:
        from omegaconf import OmegaConf, open_dict

        from kspipe.cluster import error_line, run_cluster
        from kspipe.errors import ClusterError, KspipeError

        child = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True))
        with open_dict(child):
            child.isolate = False
        try:
            return run_cluster(child, reporter, [("worker", 0, dict(os.environ))],
                               "the job in a process of its own")
        except ClusterError as err:
            message = error_line(os.path.join(reporter.run_dir, "logs", "worker.0.log"))
            if message:  # the job's own one-line error, as a run in this process gives it
                raise KspipeError(message) from err
            raise


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    return compile_programs(cfg, programs)


def compile_programs(cfg, programs):
    """Apply ``cfg.compile`` to the Reptile programs (every mode's compile stage calls this)."""
    if cfg.compile.onednn_conv:
        use_onednn(programs.train, programs.forward)
    apply_execution_strategy(dict(cfg.compile.get("execution_strategy") or {}))
    options = dict(cfg.compile.build_strategy or {})
    graph = options.get("debug_graphviz_path")
    if graph and not os.path.isabs(graph) and cfg.get("run_dir"):
        options["debug_graphviz_path"] = os.path.join(cfg.run_dir, graph)
    if graph:
        os.makedirs(os.path.dirname(options["debug_graphviz_path"]) or ".", exist_ok=True)
    if options:
        programs.compiled_train = compile_with(programs.train, options)
    return programs


#: ExecutionStrategy options of the Fluid era that Paddle 2.6.2 no longer applies anywhere.
GONE_EXECUTION_OPTIONS = ("num_iteration_per_drop_scope", "allow_op_delay",
                          "num_iteration_per_run", "use_thread_barrier",
                          "use_experimental_executor")


def apply_execution_strategy(options: dict) -> None:
    """The ExecutionStrategy options Paddle 2.6.2 still honours: ``num_threads``."""
    for name, value in options.items():
        if name == "num_threads":
            from paddle.base import core

            core.set_num_threads(int(value))
        elif name in GONE_EXECUTION_OPTIONS:
            raise ConfigError(f"compile.execution_strategy.{name}: Paddle 2.6.2 no longer "
                              f"honours it (ExecutionStrategy went with ParallelExecutor and "
                              f"CompiledProgram.with_data_parallel; the standalone executor "
                              f"manages its threads and scopes itself)")
        else:
            raise ConfigError(f"compile.execution_strategy.{name}: no such option "
                              f"(num_threads is the one Paddle 2.6.2 honours)")


ONEDNN_OPS = ("conv2d", "conv2d_grad")


def use_onednn(*programs) -> None:
    """Run the convolutions of ``programs`` with oneDNN's CPU kernels.

    On Paddle 2.6.2's CPU wheel they are about 2x faster than the default kernels for
    these small nets and give the same numbers to float rounding.  Only convolutions:
    oneDNN batch norm is slower here, and the global ``FLAGS_use_mkldnn=1`` crashes
    ("could not reshape a memory descriptor").
    """
    for program in programs:
        for op in program.global_block().ops:
            if op.type in ONEDNN_OPS:
                op._set_attr("use_mkldnn", True)


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
