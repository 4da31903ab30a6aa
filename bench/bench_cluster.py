"""Throughput and accuracy of mode=pserver or mode=collective against mode=local.

    python bench/bench_cluster.py [--mode pserver] [--iterations 300] [--workers 1 2 4]

Runs the default experiment (5-way 5-shot Omniglot-like, meta-batch 5) for the same number
of meta-iterations (so the same number of tasks) locally and on loopback clusters of
1, 2, 4 workers (and one server for pserver), and prints tasks/s (every worker's tasks
over the wall-clock time of the training phase, waits included) and test accuracy.  Each
worker's math threads are cores / workers (at least 1).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

os.environ.setdefault("GLOG_minloglevel", "2")


def run_once(iterations: int, tasks: int, *overrides) -> tuple[dict, float]:
    from kspipe.pipeline import run
    from kspipe.testing import compose_config, plugin_manager

    with tempfile.TemporaryDirectory() as folder:
        cfg = compose_config(
            [
                "+experiment=omniglot_5way",
                f"train.meta_iters={iterations}",
                "eval.baseline=false",
                "eval.interval=0",
                f"eval.tasks={tasks}",
                "train.checkpoint_every=0",
                f"run_dir={folder}/run",
                "tracking.enabled=false",
                *overrides,
            ]
        )
        start = time.perf_counter()
        metrics = run(cfg, plugin_manager())
        return metrics, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--eval-tasks", type=int, default=300)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategy", default="async")
    parser.add_argument("--mode", choices=("pserver", "collective"), default="pserver")
    parser.add_argument("--no-local", action="store_true", help="skip the local run")
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; "
        f"{args.iterations} meta-iterations x 5 tasks, {args.eval_tasks} test tasks"
    )
    rows = [] if args.no_local else [("local", *run_once(args.iterations, args.eval_tasks))]
    for workers in args.workers:
        if args.mode == "pserver":
            name = f"pserver {args.strategy} workers={workers}"
            extra = ["servers=1", f"cluster.strategy={args.strategy}"]
        else:
            name, extra = f"collective workers={workers}", []
        rows.append(
            (
                name,
                *run_once(
                    args.iterations,
                    args.eval_tasks,
                    f"mode={args.mode}",
                    f"workers={workers}",
                    *extra,
                ),
            )
        )
    print(f"{'job':<28} {'tasks/s':>8} {'test accuracy':>16} {'wall s':>7}")
    for name, m, wall in rows:
        print(
            f"{name:<28} {m['tasks_per_s']:>8.2f} {m['test_accuracy']:>9.3f} ± "
            f"{m['test_accuracy_ci95']:.3f} {wall:>7.0f}"
        )


if __name__ == "__main__":
    main()
