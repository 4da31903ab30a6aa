"""The reference implementation's options, checked against hand computations: the
non-transductive evaluation, first-order MAML (with its tail), plain SGD, sampling with
replacement and weight decay."""

import numpy as np
import pytest

from kspipe.errors import ConfigError
from kspipe.pipeline import run
from kspipe.reptile.programs import THETA, build_programs, inner_batches, tail_split
from kspipe.testing import QuietReporter, compose_config, plugin_manager, tiny_overrides
from tests.kit.adaptation import cpu_learner


def make_learner(*overrides, shape=(28, 28, 1), ways=3):

    cfg = compose_config(["model.filters=8", f"task.ways={ways}", *overrides])
    programs = build_programs(
        shape,
        ways,
        cfg.model,
        cfg.train.inner_lr,
        seed=0,
        inner_optimizer=cfg.train.inner_optimizer,
        weight_decay=cfg.train.weight_decay,
    )
    return cpu_learner(cfg, None, programs, QuietReporter())


def values(learner, names):
    return {n: np.array(learner.scope.find_var(n).get_tensor()) for n in names}


def numpy_logits(w: dict, x: np.ndarray) -> np.ndarray:
    """The one-layer net by hand: 3x3 conv (stride 1, zero padding 1), batch norm over the
    batch's own statistics (epsilon 1e-3), ReLU, dense."""
    n, c, h, wd = x.shape
    k = w["conv0.w"]  # (filters, c, 3, 3)
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, k.shape[0], h, wd), np.float64)
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,fc->nfhw", padded[:, :, i : i + h, j : j + wd], k[:, :, i, j])
    mean = out.mean(axis=(0, 2, 3), keepdims=True)
    var = out.var(axis=(0, 2, 3), keepdims=True)
    normed = (out - mean) / np.sqrt(var + 1e-3)
    normed = normed * w["norm0.scale"][None, :, None, None] + w["norm0.bias"][None, :, None, None]
    hidden = np.maximum(normed, 0).reshape(n, -1)
    return hidden @ w["dense.w"] + w["dense.b"]


def test_non_transductive_classifies_each_query_with_the_support_set_alone():
    learner = make_learner(
        "model.layers=1", "model.stride=1", "eval.transductive=false", shape=(6, 6, 1)
    )
    rng = np.random.default_rng(0)
    support = rng.random((6, 1, 6, 6), dtype=np.float32)
    queries = rng.random((3, 1, 6, 6), dtype=np.float32)
    w = values(learner, learner.p.params)
    expected = np.stack([numpy_logits(w, np.concatenate([support, q[None]]))[-1] for q in queries])
    np.testing.assert_allclose(
        learner.query_logits(support, queries), expected, rtol=1e-4, atol=1e-5
    )
    np.testing.assert_array_equal(learner.classify(support, queries), expected.argmax(axis=1))
    # transductive: the queries' own batch statistics, which differ
    learner.cfg.eval.transductive = True
    shared = numpy_logits(w, queries)
    np.testing.assert_allclose(learner.query_logits(support, queries), shared, rtol=1e-4, atol=1e-5)
    assert np.abs(shared - expected).max() > 1e-2


def task_batch(n=9, seed=0, ways=3):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 28, 28), dtype=np.float32), np.repeat(np.arange(ways), n // ways)


@pytest.mark.parametrize("tail", [None, 1])
def test_foml_moves_theta_by_the_last_inner_step(tail):
    overrides = [
        "train.algorithm=foml",
        "train.inner_iters=3",
        "train.inner_batch=4",
        "train.meta_iters=10",
        "train.meta_step=0.5",
        "train.meta_step_final=0.5",
    ]
    learner = make_learner(*overrides, *([f"train.foml_tail={tail}"] if tail else []))
    p = learner.p
    theta = values(learner, p.params)
    learner.run(p.snapshot)
    changes = []
    for seed in (1, 2):  # each task's steps by hand: what changed in the last one?
        x, y = task_batch(seed=seed)
        rng = np.random.default_rng(seed)
        if tail:
            rest, last = tail_split(y, tail)
            batches = [rest[b] for b in inner_batches(len(rest), 4, 2, rng)] + [last]
        else:
            batches = inner_batches(len(x), 4, 3, rng)
        learner.run(p.restore_theta)
        learner.steps(x, y, batches[:-1])
        before = values(learner, p.params)
        learner.steps(x, y, batches[-1:])
        after = values(learner, p.params)
        changes.append({n: after[n] - before[n] for n in p.params})
    learner.run(p.restore_snapshot)
    tasks = [(*task_batch(seed=s), np.random.default_rng(s)) for s in (1, 2)]
    learner.meta_iteration(0, tasks)
    got = values(learner, p.params + [n + THETA for n in p.params])
    for n in p.params:
        expected = theta[n] + 0.5 * (changes[0][n] + changes[1][n]) / 2
        np.testing.assert_allclose(got[n], expected, rtol=1e-5, atol=1e-6, err_msg=n)
        np.testing.assert_array_equal(got[n + THETA], got[n])


def test_sgd_steps_and_weight_decay_by_hand():
    learner = make_learner(
        "train.inner_optimizer=sgd", "train.inner_lr=0.1", "train.weight_decay=0.9"
    )
    p = learner.p
    x, y = task_batch()
    before = values(learner, p.params)
    learner.run(p.decay)
    decayed = values(learner, p.params)
    for n in p.params:
        np.testing.assert_allclose(decayed[n], before[n] * np.float32(0.9), rtol=1e-6)
    grads = [g for g in p.train.global_block().vars if g.endswith("@GRAD") and g[:-5] in p.params]
    assert grads
    out = learner.run(p.train, {"x": x, "y": y.reshape(-1, 1)}, grads)
    after = values(learner, p.params)
    for name, grad in zip(grads, out):  # plain SGD: w - lr * g, no state
        param = name[:-5]
        np.testing.assert_allclose(
            after[param], decayed[param] - 0.1 * np.asarray(grad), rtol=1e-5, atol=1e-6
        )
    assert not any("moment" in v for v in p.state)


def test_replacement_draws_each_batch_afresh():
    batches = inner_batches(6, 4, 50, np.random.default_rng(0), replacement=True)
    assert all(len(set(b)) == 4 for b in batches)  # no image twice in a batch
    # without replacement a batch follows a pass: some image waits for the next pass
    starts = [tuple(sorted(b)) for b in batches]
    assert len(set(starts)) > 5


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.algorithm=maml"], "train.algorithm='maml' is not one of reptile, foml"),
        (["train.inner_optimizer=rmsprop"], "train.inner_optimizer='rmsprop' is not one of"),
        (["train.foml_tail=1"], "train.foml_tail is for train.algorithm=foml"),
        (["train.algorithm=foml", "train.foml_tail=3"], "leaves no images"),
        (["train.weight_decay=0"], "train.weight_decay=0.0 must be more than 0"),
        (["train.replacement=true", "train.inner_batch=100"], "is more than the"),
    ],
)
def test_bad_options(tmp_path, tiny_data, overrides, message):
    cfg = compose_config(
        ["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data), *overrides]
    )
    with pytest.raises(ConfigError, match=message):
        run(cfg, plugin_manager())
