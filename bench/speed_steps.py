"""The inner step's cost, for bench/bench_speed.py ``--child steps <threads>``: ms of one
inner step per task at batch 10 and 5, T tasks side by side, two threads at once, and an
executor call's own cost (a small program)."""

from __future__ import annotations

import time

import numpy as np

EXPERIMENT = "+experiment=omniglot_5way"  # bench_speed.py's job


def step_times(threads: int) -> dict:
    """ms of one inner step: per task at batch 10 and 5, and T tasks side by side; and of
    a small program (theta's 14 copies), the cost of an executor call."""
    import paddle
    from paddle.base import core

    from kspipe.compiling import use_onednn
    from kspipe.reptile.batched import build_batched_programs, use_onednn_relu
    from kspipe.reptile.programs import build_programs
    from kspipe.testing import compose_config

    paddle.enable_static()
    core.set_num_threads(threads)
    cfg = compose_config([EXPERIMENT])
    options = dict(image_shape=(28, 28, 1), ways=5, model=cfg.model, inner_lr=0.001)
    p = build_programs(seed=0, **options)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(p.startup, scope=scope)
    rng = np.random.default_rng(0)

    def timed(program, tasks, batch, steps):
        x = rng.random((batch, tasks, 28, 28), dtype=np.float32)
        y = rng.integers(0, 5, (batch, 1) if tasks == 1 else (tasks, batch, 1))
        for _ in range(5):
            exe.run(program, feed={"x": x, "y": y}, scope=scope)
        start = time.perf_counter()
        for _ in range(steps):
            exe.run(program, feed={"x": x, "y": y}, scope=scope)
        return (time.perf_counter() - start) / steps * 1000

    start = time.perf_counter()
    for _ in range(200):
        exe.run(p.restore_theta, scope=scope)
    use_onednn(p.train)
    out = {
        "an executor call of 14 copies": (time.perf_counter() - start) / 200 * 1000,
        "1 task, batch 10": timed(p.train, 1, 10, 100),
        "1 task, batch 5": timed(p.train, 1, 5, 100),
    }
    built = {}
    for tasks, batch in ((5, 10), (10, 5), (20, 5), (3, 10), (2, 10)):
        b = built[tasks] = build_batched_programs(p, tasks, **options)
        use_onednn(b.train)
        use_onednn_relu(b.train)
        exe.run(b.startup, scope=scope)
        exe.run(b.spread, scope=scope)
        out[f"{tasks} tasks, batch {batch}"] = timed(b.train, tasks, batch, 30)
    # Two threads at once, each with its own executor and scope (kspipe's train.threads and
    # eval.threads): the time of a step of both.
    for shares, batch in (((10, 10), 5), ((3, 2), 10)):
        out[f"two threads, {' + '.join(map(str, shares))} tasks, batch {batch}"] = two_threads(
            exe, [built[t] for t in shares], batch, rng, 30
        )
    return out


def two_threads(exe, programs, batch, rng, steps) -> float:
    """ms per step of ``programs`` (side-by-side programs) run at once on threads of their
    own, each in a child scope with its own copies of the slot variables."""
    import threading

    import paddle
    from paddle.base import core

    def lane(b, x, y, times):
        core.set_num_threads(1)
        scope = paddle.static.Scope()
        run = paddle.static.Executor(paddle.CPUPlace())
        run.run(b.startup, scope=scope)
        for _ in range(5):
            run.run(b.train, feed={"x": x, "y": y}, scope=scope)
        ready.wait()
        start = time.perf_counter()
        for _ in range(steps):
            run.run(b.train, feed={"x": x, "y": y}, scope=scope)
        times.append(time.perf_counter() - start)

    ready = threading.Barrier(len(programs))
    times: list = []
    threads = [
        threading.Thread(
            target=lane,
            args=(
                b,
                rng.random((batch, b.tasks, 28, 28), dtype=np.float32),
                rng.integers(0, 5, (b.tasks, batch, 1)),
                times,
            ),
        )
        for b in programs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(times) / steps * 1000
