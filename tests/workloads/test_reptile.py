"""Reptile's programs do what the algorithm says, checked against numpy."""

import numpy as np
import pytest

from kspipe.reptile.learner import ReptileLearner
from kspipe.reptile.programs import THETA, build_programs, inner_batches, meta_step_size
from kspipe.testing import QuietReporter, compose_config


@pytest.fixture
def learner():
    import paddle

    cfg = compose_config(["model.filters=8", "task.ways=3"])
    programs = build_programs((28, 28, 1), 3, cfg.model, 0.01, seed=0)
    exe = paddle.static.Executor(paddle.CPUPlace())
    learner = ReptileLearner(cfg, None, programs, exe, paddle.static.Scope(), QuietReporter())
    learner.initialize()
    return learner


def values(learner, names):
    return {n: np.array(learner.scope.find_var(n).get_tensor()) for n in names}


def batch(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 3, n)


def test_meta_iteration_moves_theta_towards_the_mean_of_adapted_weights(learner):
    p = learner.p
    theta = values(learner, p.params)
    learner.run(p.snapshot)  # to replay the same two tasks from the same Adam state below
    adapted = []
    for seed in (1, 2):  # what the meta-iteration will do, step by step
        learner.run(p.restore_theta)
        x, y = batch(seed=seed)
        learner.adapt(x, y, 3, 2, np.random.default_rng(seed))
        adapted.append(values(learner, p.params))
    learner.run(p.restore_theta)
    for name, value in values(learner, p.params).items():
        np.testing.assert_array_equal(value, theta[name])  # restore is exact

    tasks = [(*batch(seed=s), np.random.default_rng(s)) for s in (1, 2)]
    learner.run(p.restore_snapshot)
    learner.cfg.train.inner_batch, learner.cfg.train.inner_iters = 3, 2
    learner.cfg.train.meta_iters = 10
    learner.meta_iteration(4, tasks)
    eps = meta_step_size(4, 10, learner.cfg.train.meta_step, learner.cfg.train.meta_step_final)
    after = values(learner, p.params + [n + THETA for n in p.params])
    for name in p.params:
        expected = theta[name] + eps * ((adapted[0][name] + adapted[1][name]) / 2 - theta[name])
        np.testing.assert_allclose(after[name], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(after[name + THETA], after[name])


def test_evaluate_leaves_the_whole_state_unchanged(learner, tiny_data):
    from kspipe.fewshot.data import read_omniglot

    learner.cfg.task.shots, learner.cfg.eval.inner_iters = 1, 3
    before = values(learner, learner.p.state)
    classes = read_omniglot(str(tiny_data), train_characters=20, seed=0)[2]
    accuracy, half_width = learner.evaluate(classes, 4, stream=9, label="test")
    assert 0.0 <= accuracy <= 1.0 and half_width >= 0.0
    for name, value in values(learner, learner.p.state).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_adapting_lowers_the_loss(learner):
    x, y = batch(seed=5)
    first = learner.adapt(x, y, 6, 1, np.random.default_rng(0))
    last = learner.adapt(x, y, 6, 30, np.random.default_rng(0))
    assert last < first * 0.5


def test_inference_program_matches_the_training_forward(learner):
    x, _ = batch(n=5, seed=7)
    (exported,) = learner.run(learner.p.infer, {"x": x}, [learner.p.infer_logits])
    np.testing.assert_allclose(exported, learner.predict(x), rtol=1e-4, atol=1e-5)


def test_inner_batches_cycle_through_shuffled_passes():
    batches = inner_batches(6, 4, 3, np.random.default_rng(0))
    flat = np.concatenate(batches)
    assert [len(b) for b in batches] == [4, 4, 4]
    # 12 indices: two whole passes over the 6 samples, the second shuffled anew
    assert sorted(flat[:6]) == list(range(6)) and sorted(flat[6:]) == list(range(6))
    assert list(flat[:6]) != list(flat[6:])


def test_meta_step_anneals_linearly():
    assert meta_step_size(0, 100, 1.0, 0.0) == 1.0
    assert meta_step_size(50, 100, 1.0, 0.0) == pytest.approx(0.5)
    assert meta_step_size(100, 100, 1.0, 0.2) == pytest.approx(0.2)
