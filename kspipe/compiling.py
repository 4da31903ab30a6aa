"""The compile stage's options for any workload: BuildStrategy through CompiledProgram,
the ExecutionStrategy options Paddle 2.6.2 still honours, and oneDNN convolutions."""

from __future__ import annotations

import os

from kspipe.errors import ConfigError


def compile_options(cfg, train, *others, on_cpu: bool = True):
    """Apply ``cfg.compile`` to a workload's programs; return ``train`` compiled with the
    BuildStrategy options, or None when there are none (run ``train`` as it is).

    oneDNN convolutions apply to ``train`` and ``others`` on CPU; the ExecutionStrategy's
    thread count to the process.
    """
    if cfg.compile.onednn_conv and on_cpu:
        use_onednn(train, *others)
    apply_execution_strategy(dict(cfg.compile.get("execution_strategy") or {}))
    options = build_options(cfg)
    return compile_with(train, options) if options else None


def build_options(cfg) -> dict:
    """``cfg.compile.build_strategy``, a relative ``debug_graphviz_path`` made the run
    folder's (and its folder created)."""
    options = dict(cfg.compile.build_strategy or {})
    graph = options.get("debug_graphviz_path")
    if graph and not os.path.isabs(graph) and cfg.get("run_dir"):
        options["debug_graphviz_path"] = os.path.join(cfg.run_dir, graph)
    if graph:
        os.makedirs(os.path.dirname(options["debug_graphviz_path"]) or ".", exist_ok=True)
    return options


#: ExecutionStrategy options of the Fluid era that Paddle 2.6.2 no longer applies anywhere.
GONE_EXECUTION_OPTIONS = (
    "num_iteration_per_drop_scope",
    "allow_op_delay",
    "num_iteration_per_run",
    "use_thread_barrier",
    "use_experimental_executor",
)


def check_options(cfg) -> None:
    """``cfg.compile``'s option names, before any process starts (a cluster job's compile
    stage runs in its workers, after the job began): a :class:`ConfigError` for the first
    that Paddle 2.6.2 does not honour."""
    check_execution_strategy(dict(cfg.compile.get("execution_strategy") or {}))
    names = list(cfg.compile.get("build_strategy") or {})
    if names:
        import paddle

        strategy = paddle.static.BuildStrategy()
        for name in names:
            check_build_option(strategy, name)


def check_build_option(strategy, name: str) -> None:
    if not hasattr(strategy, name):
        raise ConfigError(
            f"compile.build_strategy.{name}: Paddle's BuildStrategy has no such option"
        )


def apply_execution_strategy(options: dict) -> None:
    """The ExecutionStrategy options Paddle 2.6.2 still honours: ``num_threads``."""
    check_execution_strategy(options)
    if "num_threads" in options:
        from paddle.base import core

        core.set_num_threads(int(options["num_threads"]))


def check_execution_strategy(options: dict) -> None:
    for name in options:
        if name == "num_threads":
            continue
        if name in GONE_EXECUTION_OPTIONS:
            raise ConfigError(
                f"compile.execution_strategy.{name}: Paddle 2.6.2 no longer "
                f"honours it (ExecutionStrategy went with ParallelExecutor and "
                f"CompiledProgram.with_data_parallel; the standalone executor "
                f"manages its threads and scopes itself)"
            )
        else:
            raise ConfigError(
                f"compile.execution_strategy.{name}: no such option "
                f"(num_threads is the one Paddle 2.6.2 honours)"
            )


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
        check_build_option(strategy, name)
        setattr(strategy, name, value)
    return paddle.static.CompiledProgram(program, build_strategy=strategy)
