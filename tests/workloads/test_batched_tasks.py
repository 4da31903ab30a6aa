"""Tasks adapted side by side (grouped convolutions) take the per-task path's steps."""

import numpy as np
import pytest

from kspipe.fewshot.data import sample_task
from kspipe.reptile import evaluation
from kspipe.reptile.programs import THETA, meta_step_size
from kspipe.reptile.tasks import CURVE_STREAM, EVAL_TEST_STREAM, nchw
from kspipe.testing import QuietReporter
from tests.kit.adaptation import cpu_learner


@pytest.fixture
def make_learner(tiny_cfg):
    """A learner over the plugin's programs for the tiny config with ``overrides``."""
    from kspipe.fewshot import plugin as fewshot
    from kspipe.modes.role import Role

    def make(*overrides):
        cfg = tiny_cfg("train.meta_iters=10", "eval.inner_iters=3", *overrides)
        dataset = fewshot.kspipe_read_dataset(cfg=cfg, role=Role())
        return cpu_learner(cfg, dataset, reporter=QuietReporter())

    return make


def onednn(program) -> set:
    """(operator type, whether it runs on oneDNN's kernels) of ``program``'s operators."""
    return {
        (op.type, op.attr("use_mkldnn"))
        for op in program.global_block().ops
        if op.has_attr("use_mkldnn")
    }


def values(learner, names):
    return dict(zip(names, learner.values(names)))


def close(actual, expected, names):
    for name in names:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_sgd_meta_iterations_match_the_per_task_path(make_learner):
    batched = make_learner("train.inner_optimizer=sgd", "train.meta_batch=3")
    one_by_one = make_learner(
        "train.inner_optimizer=sgd", "train.meta_batch=3", "train.batch_tasks=false"
    )
    assert batched.train_together.tasks == 3 and one_by_one.train_together is None
    for learner in (batched, one_by_one):
        for i in range(3):
            learner.meta_iteration(i, learner.train_tasks(i))
    names = batched.p.params + [n + THETA for n in batched.p.params]
    close(values(batched, names), values(one_by_one, names), names)


def test_adam_meta_iteration_adapts_each_task_from_the_same_state(make_learner):
    learner = make_learner("train.meta_batch=3", "train.weight_decay=0.999")
    learner.meta_iteration(0, learner.train_tasks(0))  # Adam's moments are no longer zero
    p, cfg = learner.p, learner.cfg.train
    tasks = learner.train_tasks(1)
    theta = values(learner, p.params)
    learner.run(p.snapshot)
    adapted = []
    for x, y, rng in learner.train_tasks(1):  # the same tasks, each from the same state
        learner.run(p.restore_snapshot)
        learner.adapt(x, y, cfg.inner_batch, cfg.inner_iters, rng)
        adapted.append(values(learner, p.state))
    learner.run(p.restore_snapshot)

    learner.meta_iteration(1, tasks)
    eps = meta_step_size(1, cfg.meta_iters, cfg.meta_step, cfg.meta_step_final)
    moments = [n for n in p.state if "_moment" in n]
    expected = {
        n: theta[n] + eps * (np.mean([a[n] for a in adapted], 0) - theta[n]) for n in p.params
    }
    expected.update({n: np.mean([a[n] for a in adapted], 0) for n in moments})
    close(values(learner, p.params + moments), expected, p.params + moments)
    counts = [n for n in p.state if "_pow_acc" in n]
    close(values(learner, counts), adapted[0], counts)


def test_batched_evaluation_gives_the_per_task_logits_and_accuracy(make_learner):
    learner = make_learner("eval.batch_tasks=3", "eval.tasks=5", "eval.queries=2")
    learner.meta_iteration(0, learner.train_tasks(0))
    # built at the first evaluation, not in the job's start-up
    assert 3 in learner.p.later and 3 not in learner.p.batched
    together, cfg = learner.eval_together, learner.cfg
    assert together.tasks == 3 and not learner.p.later
    # compiled as the programs built at the start are: oneDNN's convolutions and ReLU
    built = learner.train_together
    for late, early in ((together.train, built.train), (together.forward, built.forward)):
        assert ("conv2d", True) in onednn(early) and onednn(late) == onednn(early)
    before = values(learner, learner.p.state)
    batched = learner.evaluate(learner.dataset.test, 5, EVAL_TEST_STREAM, "test")
    for name, value in values(learner, learner.p.state).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    one_by_one = evaluation.evaluate(
        learner,
        None,
        learner.reporter,
        [evaluation.Evaluation(learner.dataset.test, 5, EVAL_TEST_STREAM, "test")],
    )[0]
    assert batched == pytest.approx(one_by_one)

    tasks = []  # the same three tasks, side by side and then one by one
    for k in range(3):
        rng = np.random.default_rng([cfg.seed, 7, k])
        t = sample_task(learner.dataset.test, cfg.task.ways, cfg.task.shots, 2, rng)
        tasks.append((nchw(t.support_x), t.support_y, nchw(t.query_x)))
    learner.adapt_together(
        together,
        [(sx, sy, np.random.default_rng(k)) for k, (sx, sy, _) in enumerate(tasks)],
        cfg.eval.inner_batch,
        cfg.eval.inner_iters,
    )
    (logits,) = learner.run(
        together.forward, together.stack([qx for _, _, qx in tasks]), [together.logits]
    )
    learner.run(learner.p.snapshot)
    for k, (sx, sy, qx) in enumerate(tasks):
        learner.run(learner.p.restore_snapshot)
        learner.adapt(sx, sy, cfg.eval.inner_batch, cfg.eval.inner_iters, np.random.default_rng(k))
        np.testing.assert_allclose(logits[k], learner.predict(qx), rtol=1e-4, atol=1e-4)


def test_configurations_it_does_not_cover_take_the_per_task_path(make_learner):
    learner = make_learner("train.algorithm=foml", "eval.transductive=false")
    assert learner.train_together is None and learner.eval_together is None
    assert not learner.p.batched and not learner.p.later
    learner.meta_iteration(0, learner.train_tasks(0))


@pytest.mark.parametrize(
    "options",
    [[], ["train.weight_decay=0.999"], ["train.inner_optimizer=sgd"]],
    ids=["adam", "decay", "sgd"],
)
def test_the_meta_batch_shared_among_threads_takes_one_programs_steps(make_learner, options):
    shared = make_learner("train.meta_batch=5", "train.threads=2", *options)
    alone = make_learner("train.meta_batch=5", "train.threads=1", *options)
    assert [lane.together.tasks for lane in shared.train_lanes()] == [3, 2]
    assert alone.train_lanes() == [] and alone.train_together.tasks == 5
    names = shared.p.state + [n + THETA for n in shared.p.params]
    for i in range(2):
        for learner in (shared, alone):
            learner.meta_iteration(i, learner.train_tasks(i))
        close(values(shared, names), values(alone, names), names)
        # Both go on from the same state: this small model's training is chaotic enough
        # that float rounding (sums in another order) would grow past any tolerance.
        for name, value in values(alone, names).items():
            shared.scope.find_var(name).get_tensor().set(value, shared.exe.place)


def test_test_tasks_spread_over_threads_score_as_in_one(make_learner):
    learner = make_learner("eval.batch_tasks=2", "eval.tasks=9")
    learner.meta_iteration(0, learner.train_tasks(0))
    before = values(learner, learner.p.state)
    scores = {}
    for threads in (1, 3):
        learner.cfg.eval.threads = threads
        scores[threads] = learner.evaluate(learner.dataset.test, 9, EVAL_TEST_STREAM, "test")
    assert len(learner._lanes) == 3
    assert scores[3] == pytest.approx(scores[1], abs=1e-12)
    for name, value in values(learner, learner.p.state).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_evaluations_at_once_score_as_each_alone(make_learner, monkeypatch):
    """A learning curve's point adapts its train and test tasks on the threads together:
    the same accuracies as each evaluation alone, and each one's progress counted apart."""
    learner = make_learner("eval.batch_tasks=2", "eval.threads=2")
    learner.meta_iteration(0, learner.train_tasks(0))
    evaluations = [
        evaluation.Evaluation(learner.dataset.train, 3, CURVE_STREAM, "train"),
        evaluation.Evaluation(learner.dataset.test, 5, EVAL_TEST_STREAM, "test"),
    ]
    alone = [learner.evaluate(e.classes, e.tasks, e.stream, e.label) for e in evaluations]
    shown = []
    monkeypatch.setattr(
        learner.reporter,
        "progress",
        lambda label, done, total, values: shown.append((label, done, total)),
    )
    assert learner.evaluate_all(evaluations) == alone  # the same tasks, the same steps
    # groups of two, never across evaluations: 2 + 1 train tasks, then 2 + 2 + 1 test tasks
    assert shown == [
        ("train", 2, 3),
        ("train", 3, 3),
        ("test", 2, 5),
        ("test", 4, 5),
        ("test", 5, 5),
    ]


def test_each_executor_runs_on_one_thread_the_models_on_the_callers(make_learner, monkeypatch):
    """One executor, one thread (kspipe/reptile/lanes.py): under Paddle's serial executor,
    which every job runs, an executor run on two threads crashed in oneDNN."""
    import threading

    from kspipe.reptile.lanes import Lane

    threads, run = {}, Lane.run

    def recorded(lane, program, feed=None, fetch=()):
        threads.setdefault(id(lane.exe), set()).add(threading.get_ident())
        return run(lane, program, feed, fetch)

    monkeypatch.setattr(Lane, "run", recorded)
    learner = make_learner(
        "train.meta_batch=5",
        "train.threads=2",
        "eval.batch_tasks=2",
        "eval.tasks=6",
        "eval.threads=2",
    )
    try:
        for i in range(2):
            learner.meta_iteration(i, learner.train_tasks(i))
            learner.evaluate(learner.dataset.test, 6, EVAL_TEST_STREAM, "test")
    finally:
        learner.close()
    assert threads.pop(id(learner.exe)) == {threading.get_ident()}
    assert len(threads) == 4  # two lanes training, two evaluating
    assert all(len(ran_on) == 1 for ran_on in threads.values()), threads


def test_the_training_lanes_first_step_on_blank_images_leaves_no_trace(make_learner):
    """``warm_up`` runs each lane's first step while the job's thread initialises the model
    (as a job does): the meta-iterations after it are those of a learner that never ran
    it, bit for bit."""
    warmed = make_learner("train.meta_batch=5", "train.threads=2")
    plain = make_learner("train.meta_batch=5", "train.threads=2")
    try:
        warmed.warm_up()
        assert len(warmed._warming) == 2
        warmed.initialize()  # beside the lanes' steps; the same seeded values again
        names = warmed.p.state + [n + THETA for n in warmed.p.params]
        for i in range(2):
            for learner in (warmed, plain):
                learner.meta_iteration(i, learner.train_tasks(i))
        for name, value in values(plain, names).items():
            np.testing.assert_array_equal(values(warmed, [name])[name], value, err_msg=name)
        assert warmed._warming == []
    finally:
        warmed.close()
        plain.close()
