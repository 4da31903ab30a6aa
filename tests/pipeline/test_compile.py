"""The compile stage: oneDNN convolutions give the default kernels' numbers; BuildStrategy
options are applied by name and unknown ones refused."""

from pathlib import Path

import numpy as np
import pytest

from kspipe import compiling
from kspipe.errors import ConfigError
from kspipe.modes.role import Role
from kspipe.reptile import plugin as reptile
from kspipe.reptile.programs import build_programs
from kspipe.testing import compose_config


def train_steps(onednn: bool, build_strategy=None):
    import paddle

    cfg = compose_config(["model.filters=16", f"compile.onednn_conv={onednn}"])
    if build_strategy:
        cfg.compile.build_strategy = build_strategy
    programs = build_programs((28, 28, 1), 5, cfg.model, 0.01, seed=0)
    programs = reptile.kspipe_compile_program(cfg=cfg, role=Role(), programs=programs)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(programs.startup, scope=scope)
    rng = np.random.default_rng(0)
    losses = []
    for batch in (10, 5, 7):
        x = rng.random((batch, 1, 28, 28), dtype=np.float32)
        y = rng.integers(0, 5, (batch, 1))
        (loss,) = exe.run(
            programs.train_program, feed={"x": x, "y": y}, fetch_list=[programs.loss], scope=scope
        )
        losses.append(float(np.asarray(loss).mean()))
    return programs, np.array(losses)


def first_step(onednn: bool) -> tuple:
    """The model's logits before any step, and the first step's loss and gradients."""
    import paddle

    cfg = compose_config(["model.filters=16", f"compile.onednn_conv={onednn}"])
    programs = build_programs((28, 28, 1), 5, cfg.model, 0.01, seed=0)
    programs = reptile.kspipe_compile_program(cfg=cfg, role=Role(), programs=programs)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(programs.startup, scope=scope)
    rng = np.random.default_rng(0)
    x = rng.random((10, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 5, (10, 1))
    (logits,) = exe.run(programs.forward, feed={"x": x}, fetch_list=[programs.logits], scope=scope)
    names = [p.name for p in programs.train_program.all_parameters() if p.trainable]
    loss, *grads = exe.run(
        programs.train_program,
        feed={"x": x, "y": y},
        fetch_list=[programs.loss, *(f"{n}@GRAD" for n in names)],
        scope=scope,
    )
    return logits, loss, dict(zip(names, grads))


def test_onednn_convolutions_match_the_default_kernels():
    """The same numbers to float rounding: the logits, the first step's loss and every
    gradient.  Over a few Adam steps the runs drift further apart (Adam divides by each
    gradient's running size, so rounding in a tiny gradient becomes a step of another
    size), and how far depends on the CPU's kernels: the losses are compared loosely."""
    programs, losses = train_steps(onednn=True)
    conv_ops = [op for op in programs.train.global_block().ops if op.type.startswith("conv2d")]
    assert conv_ops and all(op.attr("use_mkldnn") for op in conv_ops)
    _, default_losses = train_steps(onednn=False)
    np.testing.assert_allclose(losses, default_losses, rtol=1e-3)
    (logits, loss, grads), (logits0, loss0, grads0) = first_step(True), first_step(False)
    np.testing.assert_allclose(logits, logits0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, loss0, rtol=1e-5)
    assert grads.keys() == grads0.keys() and "conv0.w" in grads
    for name, grad in grads.items():
        scale = float(np.abs(grads0[name]).max())
        np.testing.assert_allclose(grad, grads0[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def test_build_strategy_options_compile_the_training_program():
    programs, losses = train_steps(onednn=False, build_strategy={"enable_inplace": False})
    assert programs.compiled_train is not None
    assert np.isfinite(losses).all()


def test_build_strategy_options_hold_on_lanes_that_share_programs(tiny_cfg):
    """Paddle binds a CompiledProgram to the scope it first ran in: two training lanes of
    two tasks each, and two evaluation lanes, each run a compiled program of their own."""
    from kspipe.pipeline import run
    from kspipe.testing import plugin_manager

    cfg = tiny_cfg(
        "+compile.build_strategy.fuse_elewise_add_act_ops=true",
        "train.meta_batch=4",
        "train.threads=2",
        "eval.threads=2",
        "eval.batch_tasks=2",
        "eval.tasks=4",
        "eval.interval=0",
    )
    metrics = run(cfg, plugin_manager())
    assert 0 <= metrics["test_accuracy"] <= 1 and np.isfinite(metrics["tasks_per_s"])


def test_unknown_build_strategy_option_is_named():
    with pytest.raises(ConfigError, match="compile.build_strategy.use_hierarchical_allreduce2"):
        train_steps(onednn=False, build_strategy={"use_hierarchical_allreduce2": True})


def test_graphviz_path_writes_the_program_graph_as_an_artifact(tiny_cfg):
    from mlflow import MlflowClient

    from kspipe.pipeline import run
    from kspipe.testing import plugin_manager

    cfg = tiny_cfg(
        "+compile.build_strategy.debug_graphviz_path=graph/program",
        "+compile.build_strategy.fuse_elewise_add_act_ops=true",
    )
    run(cfg, plugin_manager())
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    (record,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    dots = [a.path for a in client.list_artifacts(record.info.run_id, "graph")]
    assert "graph/program_original_graph.dot" in dots and all(p.endswith(".dot") for p in dots)
    text = (Path(cfg.run_dir) / "graph" / "program_original_graph.dot").read_text()
    assert text.startswith("digraph") and "conv2d" in text


@pytest.mark.parametrize(
    "option, message",
    [
        ("num_iteration_per_drop_scope", "no longer honours it"),
        ("allow_op_delay", "no longer honours it"),
        ("warp_speed", "no such option"),
    ],
)
def test_execution_strategy_options(option, message):
    with pytest.raises(ConfigError, match=f"compile.execution_strategy.{option}: .*{message}"):
        compiling.apply_execution_strategy({option: 1})
    compiling.apply_execution_strategy({"num_threads": 2})
