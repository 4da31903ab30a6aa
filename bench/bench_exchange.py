"""The parameter servers' exchange: what one step costs, and a generic workload's speed.

    python bench/bench_exchange.py [--params 420,112451] [--steps 200] [--skip-workload]
                                   [--epochs 8] [--repeats 5]

1. One exchange step of each strategy on a loopback cluster (1 server, 2 workers), for
   parameter sets of the given sizes: the parts of a step (the async push and pull, the sync
   round's all-reduce, write and barrier) and the whole step, in ms (mean over the steps,
   worker 0's view).  The job is bench/exchange_steps.py, started by kspipe's launcher.
2. The example classifier plugin (plugins/kspipe-classifier, installed into a temporary
   folder as a user would) trained with ``kspipe +experiment=blobs`` at batch 64: local,
   then ``mode=pserver workers=2`` with each strategy; samples/s (all workers' samples over
   the slowest worker's training time) and test accuracy, and the ratio to local.  The
   jobs run in turn, ``--repeats`` times over (local, sync, async, geo, local, ...), so a
   slow spell of the machine falls on every job alike; each job's median is compared
   with local's median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_JOB = Path(__file__).with_name("exchange_steps.py")


def exchange_steps(folder: Path, params: int, steps: int) -> dict:
    from kspipe.cluster.plan import launch_plan
    from kspipe.launchers.watcher import Cluster

    out = {}
    for strategy in ("async", "sync", "geo"):
        run = folder / f"{strategy}-{params}"
        run.mkdir(parents=True)
        cluster = Cluster(str(run), echo_first_worker=False)
        plan = launch_plan("pserver", 2, 1, threads=1)
        try:
            for p in plan:
                cluster.start(
                    p.role,
                    p.index,
                    p.env,
                    [sys.executable, str(STEPS_JOB), strategy, str(params), str(steps), str(run)],
                )
            cluster.wait(timeout_s=600)
        finally:
            cluster.stop()
        out[strategy] = json.loads((run / "worker0.json").read_text())
    return out


def classifier_runs(folder: Path, epochs: int, repeats: int, jobs: dict) -> dict:
    """{job: [its runs' metrics]} for ``jobs`` ({name: (overrides, kspipe tree or None)}),
    alternated ``repeats`` times over, the plugin installed into ``folder`` first."""
    site, source = folder / "site", folder / "src"
    shutil.copytree(
        ROOT / "plugins" / "kspipe-classifier",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
        + [str(source)],
        check=True,
        env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"),
    )
    out = {name: [] for name in jobs}
    for repeat in range(repeats):
        for number, (name, (overrides, tree)) in enumerate(jobs.items()):
            run = folder / f"job{number}-{repeat}"
            path = os.pathsep.join(([tree] if tree else []) + [str(site)])
            env = {k: v for k, v in os.environ.items() if k != "KSPIPE_DISABLE_PLUGIN_AUTOLOAD"}
            result = subprocess.run(
                [sys.executable, "-m", "kspipe.cli.command", "+experiment=blobs", *overrides]
                + ["classifier.batch_size=64", "classifier.train_points=16384"]
                + [f"classifier.epochs={epochs}", "tracking.enabled=false", f"run_dir={run}"],
                cwd=folder,
                env=dict(env, PYTHONPATH=path),
                capture_output=True,
                text=True,
            )
            if result.returncode:
                raise SystemExit(f"{name} failed:\n{result.stderr[-2000:]}")
            out[name].append(json.loads((run / "metrics.json").read_text()))
    return out


def print_rates(runs: dict, width: int = 14) -> None:
    """Each job's median rate, against local's median, with its runs and accuracies."""
    local = statistics.median(m["samples_per_s"] for m in runs["local"])
    for name, metrics in runs.items():
        rates = [m["samples_per_s"] for m in metrics]
        rate = statistics.median(rates)
        accuracies = [m["test_accuracy"] for m in metrics]
        print(
            f"  {name:<{width}} median {rate:9,.0f} samples/s  {rate / local:5.2f}x local  "
            f"(runs: {', '.join(f'{r:,.0f}' for r in rates)}; test accuracy "
            f"{min(accuracies):.3f}-{max(accuracies):.3f})"
        )


#: The parameter-server jobs this bench compares with local: {name: (overrides, None)}.
PSERVER_JOBS = {"local": (["mode=local"], None)} | {
    f"pserver {strategy}": (
        ["mode=pserver", "workers=2", "servers=1", f"cluster.strategy={strategy}"],
        None,
    )
    for strategy in ("sync", "async", "geo")
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--params",
        default="420,112451",
        help="parameter counts to exchange (420: the classifier's; 112,451: "
        "Reptile's Omniglot model)",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-workload", action="store_true")
    parser.add_argument(
        "--epochs", type=int, default=8, help="the classifier's epochs (256 steps of batch 64 each)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of each classifier job, alternated"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print("one exchange step, 1 server, 2 workers on 127.0.0.1 (ms, worker 0)")
        for params in (int(p) for p in args.params.split(",")):
            for strategy, t in exchange_steps(folder, params, args.steps).items():
                parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in t["parts"].items())
                print(
                    f"  {params:>7} parameters  {strategy:<5}  step {t['step'] * 1e3:6.2f}"
                    f"  ({parts})"
                )
        if args.skip_workload:
            return
        print(
            f"classifier plugin (+experiment=blobs), batch 64, 16,384 points, "
            f"{args.epochs} epochs, {args.repeats} runs of each job, alternated"
        )
        runs = classifier_runs(folder, args.epochs, args.repeats, PSERVER_JOBS)
        print_rates(runs)


if __name__ == "__main__":
    main()
