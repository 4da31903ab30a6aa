"""The compile stage: oneDNN convolutions give the default kernels' numbers; BuildStrategy
options are applied by name and unknown ones refused."""

import numpy as np
import pytest

from kspipe.builtin import local, reptile
from kspipe.errors import ConfigError
from kspipe.testing import compose_config


def train_steps(onednn: bool, build_strategy=None):
    import paddle

    cfg = compose_config(["model.filters=16", f"compile.onednn_conv={onednn}"])
    if build_strategy:
        cfg.compile.build_strategy = build_strategy
    programs = reptile.build_programs((28, 28, 1), 5, cfg.model, 0.01, seed=0)
    programs = local.kspipe_compile_program(cfg=cfg, role=None, programs=programs)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(programs.startup, scope=scope)
    rng = np.random.default_rng(0)
    losses = []
    for batch in (10, 5, 7):
        x = rng.random((batch, 1, 28, 28), dtype=np.float32)
        y = rng.integers(0, 5, (batch, 1))
        (loss,) = exe.run(programs.train_program, feed={"x": x, "y": y},
                          fetch_list=[programs.loss], scope=scope)
        losses.append(float(np.asarray(loss).mean()))
    (logits,) = exe.run(programs.forward, feed={"x": x}, fetch_list=[programs.logits], scope=scope)
    return programs, np.array(losses), logits


def test_onednn_convolutions_match_the_default_kernels():
    programs, losses, logits = train_steps(onednn=True)
    conv_ops = [op for op in programs.train.global_block().ops if op.type.startswith("conv2d")]
    assert conv_ops and all(op.attr("use_mkldnn") for op in conv_ops)
    _, default_losses, default_logits = train_steps(onednn=False)
    np.testing.assert_allclose(losses, default_losses, rtol=1e-4)
    np.testing.assert_allclose(logits, default_logits, rtol=1e-3, atol=1e-3)


def test_build_strategy_options_compile_the_training_program():
    programs, losses, _ = train_steps(onednn=False, build_strategy={"enable_inplace": False})
    assert programs.compiled_train is not None
    assert np.isfinite(losses).all()


def test_unknown_build_strategy_option_is_named():
    with pytest.raises(ConfigError, match="compile.build_strategy.use_hierarchical_allreduce2"):
        train_steps(onednn=False, build_strategy={"use_hierarchical_allreduce2": True})
