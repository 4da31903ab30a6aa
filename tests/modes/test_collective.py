"""mode=collective on CPU: two real processes whose programs all-reduce through gloo, checked
against a one-process reference of the same computation; the fused exchange (one a step)
checked against an all-reduce of each gradient and parameter on its own."""

import glob
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from kspipe.cluster.plan import launch_plan
from kspipe.errors import ConfigError
from kspipe.launchers.watcher import Cluster
from kspipe.modes.role import Role
from kspipe.pipeline import run
from kspipe.testing import QuietReporter, compose_config, plugin_manager, tiny_overrides
from tests.kit.adaptation import cpu_learner


class Worker(Role):
    """Worker ``index`` of two, played inside this one process."""

    def __init__(self, index):
        super().__init__()
        self.index = index

    def worker_num(self):
        return 2

    def worker_index(self):
        return self.index


def reference(cfg, iterations):
    """Two learners in one process, each with its own scope and Adam state, running the
    global meta-iterations w, w+2, ...; after each pair the mean of their parameters (what
    the collective program's c_allreduce_sum and 1/2 scale compute) goes to both."""
    import paddle

    from kspipe.fewshot import plugin as open_ks
    from kspipe.reptile import plugin as reptile
    from kspipe.reptile.learner import ReptileLearner

    paddle.enable_static()
    dataset = open_ks.kspipe_read_dataset(cfg=cfg, role=Role())
    exe = paddle.static.Executor(paddle.CPUPlace())
    learners = []
    for w in range(2):
        programs = reptile.kspipe_build_program(cfg=cfg, dataset=dataset, role=Role())
        programs = reptile.kspipe_compile_program(cfg=cfg, role=Role(), programs=programs)
        learner = ReptileLearner(
            cfg, dataset, programs, exe, paddle.static.Scope(), QuietReporter(), Worker(w)
        )
        learner.initialize()
        learners.append(learner)
    names = learners[0].p.params
    for step in range(iterations // 2):
        for w, learner in enumerate(learners):
            learner.meta_iteration(2 * step + w, learner.train_tasks(2 * step + w))
        mean = {
            n: (learners[0].values([n])[0] + learners[1].values([n])[0]) * np.float32(0.5)
            for n in names
        }
        for learner in learners:
            for name, value in mean.items():
                learner.scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
            learner.run(learner.p.save_theta)
    return mean


def reference_alone(cfg, iterations):
    """Worker 0's iterations with no exchange at all."""
    from kspipe.fewshot import plugin as open_ks

    dataset = open_ks.kspipe_read_dataset(cfg=cfg, role=Role())
    learner = cpu_learner(cfg, dataset, reporter=QuietReporter(), role=Worker(0))
    for iteration in range(0, iterations, 2):
        learner.meta_iteration(iteration, learner.train_tasks(iteration))
    params = learner.p.params
    return dict(zip(params, learner.values(params)))


def test_collective_workers_end_with_the_one_process_reference(tmp_path, tiny_data):
    iterations = 6
    common = [
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, tiny_data),
        f"train.meta_iters={iterations}",
        "train.checkpoint_every=100",
        "eval.baseline=false",
        "eval.interval=0",
        "tracking.enabled=false",
    ]
    metrics = run(
        compose_config([*common, "mode=collective", "workers=2", "cluster.timeout_s=300"]),
        plugin_manager(),
    )
    assert metrics["worker0/tasks_per_s"] > 0 and metrics["worker1/tasks_per_s"] > 0
    # the first worker's checkpoint after its last meta-iteration holds the shared theta
    (saved,) = glob.glob(str(tmp_path / "run" / "checkpoints" / "checkpoint-*" / "state.pdparams"))
    with open(saved, "rb") as f:
        cluster = pickle.load(f)
    expected = reference(compose_config(common), iterations)
    for name, value in expected.items():
        np.testing.assert_allclose(cluster[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # worker 0 alone (no exchange) ends elsewhere: the comparison can tell
    alone = reference_alone(compose_config(common), iterations)
    assert max(np.abs(alone[n] - expected[n]).max() for n in expected) > 1e-3


JOB = Path(__file__).with_name("collective_job.py")


def collective_job(tmp_path, workers, steps, gather_bytes):
    """collective_job.py on ``workers`` processes: each one's record."""
    out = tmp_path / "out"
    out.mkdir()
    cluster = Cluster(str(tmp_path), echo_first_worker=False)
    try:
        for p in launch_plan("collective", workers, threads=1):
            command = [sys.executable, str(JOB), str(out), str(steps), str(gather_bytes)]
            cluster.start(p.role, p.index, p.env, command)
        cluster.wait(timeout_s=300)
    finally:
        cluster.stop()
    return [dict(np.load(out / f"worker{w}.npz")) for w in range(workers)]


def assert_bits_equal(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert np.array_equal(actual.view(np.uint32), expected.view(np.uint32)), what


@pytest.mark.parametrize(
    "workers, gather_bytes, exact",
    [
        (2, -1, True),  # the fused buffer along the workers' chain of sockets (the default)
        (2, 64 * 1024, True),  # the model's 701 weights all-gathered through gloo
        (2, 0, True),  # the fused buffer through gloo's ring all-reduce
        (3, -1, False),  # summed in worker order, gloo's ring in its segments' order
        (3, 64 * 1024, False),
    ],
)
def test_fused_exchange_equals_one_all_reduce_per_tensor(tmp_path, workers, gather_bytes, exact):
    """The mean gradients of each step, the parameters after them, and a parameter average:
    with two workers equal bit for bit whichever way the fused buffer is summed (a + b is
    b + a in floating point); with three, to float rounding (the order of the sum differs);
    and the same on every worker, bit for bit, in every case."""
    steps = 4
    records = collective_job(tmp_path, workers, steps, gather_bytes)
    first = records[0]
    for other in records[1:]:  # every worker applies the same mean
        for key, value in first.items():
            assert_bits_equal(other[key], value, f"worker 0 and another differ at {key}")
    compared = [k.split("/", 1)[1] for k in first if k.startswith("each/")]
    assert len(compared) == steps * 6 + 6 + 6  # 3 layers' weights and biases
    for key in compared:
        each, fused = first[f"each/{key}"], first[f"fused/{key}"]
        if exact:
            assert_bits_equal(fused, each, key)
        else:
            np.testing.assert_allclose(fused, each, rtol=1e-5, atol=1e-7, err_msg=key)
    # worker w averaged its parameters times w + 1: the mean is them times (workers + 1) / 2
    np.testing.assert_allclose(
        first["fused/average/fc_0.w_0"],
        first["fused/param/fc_0.w_0"] * (workers + 1) / 2,
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["devices=[0,1]"], "this Paddle is a CPU build, so NCCL is not available"),
        (["devices='0'"], "this Paddle is a CPU build"),
        (["workers=0"], "workers=0 must be at least 1"),
    ],
)
def test_bad_collective_settings(tmp_path, tiny_data, overrides, message):
    cfg = compose_config(
        [
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "mode=collective",
            *overrides,
        ]
    )
    with pytest.raises(ConfigError, match=message):
        run(cfg, plugin_manager())
