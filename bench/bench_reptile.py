"""Speed of Reptile in kspipe, against the same inner step in a bare Paddle loop.

    python bench/bench_reptile.py             # step and meta-iteration speed (~1 minute)
    python bench/bench_reptile.py --full-run  # also the whole default job: time, peak memory

Settings are those of ``+experiment=omniglot_5way`` (5-way, meta-batch 5, inner batch 10,
5 inner Adam steps), on the embedded KanjiVG data set.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np  # noqa: E402


def bare_step_ms(programs, exe, scope, batch: int, steps: int) -> float:
    """One Adam step of the same program on in-memory data, nothing else."""
    rng = np.random.default_rng(0)
    x = rng.random((batch, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 5, (batch, 1))
    for _ in range(10):
        exe.run(programs.train, feed={"x": x, "y": y}, scope=scope)
    start = time.perf_counter()
    for _ in range(steps):
        exe.run(programs.train, feed={"x": x, "y": y}, scope=scope)
    return (time.perf_counter() - start) / steps * 1000


class Silent:
    run_dir = ""

    def progress(self, *args, **kwargs):
        pass


def pipeline_rate(cfg, dataset, programs, exe, scope, iterations: int) -> tuple[float, float]:
    """Meta-iterations per second through kspipe's learner, task sampling included."""
    from kspipe.fewshot.data import Prefetcher
    from kspipe.reptile.learner import ReptileLearner

    learner = ReptileLearner(cfg, dataset, programs, exe, scope, Silent())
    learner.initialize()
    for i in range(3):  # warm the image cache and the programs
        learner.meta_iteration(i, learner.train_tasks(i))
    feed = Prefetcher(learner.train_tasks, range(3, 3 + iterations), depth=3)
    start = time.perf_counter()
    for i, tasks in feed:
        learner.meta_iteration(i, tasks)
    elapsed = time.perf_counter() - start
    feed.close()
    return iterations / elapsed, iterations * cfg.train.meta_batch / elapsed


def full_run() -> tuple[float, float, str]:
    """Wall time and peak resident memory of ``kspipe +experiment=omniglot_5way``."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        result = subprocess.run(
            ["kspipe", "+experiment=omniglot_5way"], cwd=folder, capture_output=True, text=True
        )
        wall = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    summary = [line for line in result.stdout.splitlines() if line.startswith("kspipe: done")]
    return wall, peak_mib, summary[0] if summary else result.stderr[-500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--full-run", action="store_true")
    parser.add_argument(
        "--default-kernels",
        action="store_true",
        help="Paddle's default conv kernels instead of oneDNN's",
    )
    args = parser.parse_args()

    import paddle

    from kspipe.fewshot import plugin as open_ks
    from kspipe.modes.role import Role
    from kspipe.reptile import plugin as reptile
    from kspipe.testing import compose_config

    paddle.enable_static()
    cfg = compose_config(["+experiment=omniglot_5way"])
    dataset = open_ks.kspipe_read_dataset(cfg=cfg, role=Role())
    programs = reptile.kspipe_build_program(cfg=cfg, dataset=dataset, role=Role())
    if args.default_kernels:
        cfg.compile.onednn_conv = False
    programs = reptile.kspipe_compile_program(cfg=cfg, role=Role(), programs=programs)
    exe = paddle.static.Executor(paddle.CPUPlace())
    scope = paddle.static.Scope()
    exe.run(programs.startup, scope=scope)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, Paddle {paddle.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    step10 = bare_step_ms(programs, exe, scope, 10, 200)
    step5 = bare_step_ms(programs, exe, scope, 5, 200)
    inner = cfg.train.inner_iters
    kernels = "default" if args.default_kernels else "oneDNN"
    print(f"convolution kernels: {kernels}")
    print(f"bare Paddle inner step: {step10:.2f} ms at batch 10, {step5:.2f} ms at batch 5")
    print(
        f"bare loop bound: {1000 / (inner * step10):.2f} tasks/s "
        f"({inner} steps of batch 10 per task)"
    )
    meta_rate, task_rate = pipeline_rate(cfg, dataset, programs, exe, scope, args.iterations)
    print(
        f"kspipe: {meta_rate:.3f} meta-iterations/s, {task_rate:.2f} tasks/s "
        f"(meta-batch {cfg.train.meta_batch})"
    )
    overhead = (1000 / task_rate) / (inner * step10) - 1
    print(f"pipeline overhead over the bare loop: {overhead * 100:+.1f}%")
    if args.full_run:
        wall, peak, summary = full_run()
        print(f"full default run: {wall:.0f} s wall, peak resident memory {peak:.0f} MiB")
        print(f"  {summary}")


if __name__ == "__main__":
    sys.exit(main())
