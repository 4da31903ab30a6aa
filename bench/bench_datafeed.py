"""Samples/s of the ctr model fed by Paddle's C++ reader threads vs. fed from Python.

    python bench/bench_datafeed.py [--files 8 --lines-per-file 25000 --repeats 3]
                                   [--pipeline | --pipeline-only]

Writes the generated click-through set (MultiSlot files) to a temporary folder, builds
the ``ctr_datafeed`` experiment's model through kspipe's own stages, and trains one epoch
over the same files three ways, each from freshly initialised weights:

* ``train_from_dataset`` (QueueDataset) with 1 reader thread, and with 2;
* the Python-fed loop: each line parsed in Python (``kspipe.datafeed.python_batches``,
  LoDTensors for the sparse slots) and one ``Executor.run`` per batch.

With ``--pipeline`` it also runs the whole experiment (2 epochs, test AUC on the held-out
file) in one process and on a 1-server, 2-worker loopback cluster, side by side:
``--repeats`` runs of each, alternating, the best rate of each and its ratio to local
(``--pipeline-only``: these rows alone).  Each run's rate is samples over the workers'
wall-clock training time, their waits for the servers included.

Prints samples/s (best of ``--repeats``, each run in a fresh process), the ratio to the
Python-fed loop, and how long kspipe's check of every line (before training) takes.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("GLOG_minloglevel", "2")
_DEBUG = tempfile.TemporaryDirectory(prefix="kspipe-bench-")  # removed at exit


def build(folder: str, batch_size: int):
    import paddle

    from kspipe.ctr import plugin as ctr
    from kspipe.datafeed import plugin as datafeed
    from kspipe.modes.role import Role
    from kspipe.testing import compose_config

    paddle.enable_static()
    cfg = compose_config(
        [
            "+experiment=ctr_datafeed",
            f"datafeed.desc={folder}/ctr.prototxt",
            f"datafeed.train_files={folder}/train",
            f"datafeed.test_files={folder}/test",
            f"datafeed.batch_size={batch_size}",
            "datafeed.fetch=[]",
            "datafeed.validate=false",
            "tracking.enabled=false",
        ]
    )
    role = Role()
    dataset = datafeed.kspipe_read_dataset(cfg=cfg, role=role)
    programs = ctr.kspipe_build_program(cfg=cfg, dataset=dataset, role=role)
    programs = ctr.kspipe_compile_program(cfg=cfg, role=role, programs=programs)
    return dataset, programs


def fresh(programs):
    import paddle

    from kspipe.pipeline import make_executor

    scope = paddle.static.Scope()
    # its debug descriptions go to a temporary folder, not the current one
    exe = make_executor(paddle.CPUPlace(), _DEBUG.name)
    exe.run(programs.startup, scope=scope)
    return exe, scope


def dataset_rate(dataset, programs, threads: int) -> float:
    import contextlib
    import io

    from kspipe.ctr.training import make_dataset

    dataset.threads = threads
    exe, scope = fresh(programs)
    files = make_dataset(dataset)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        exe.train_from_dataset(program=programs.main, dataset=files, scope=scope, thread=threads)
    return dataset.train_counts.total / (time.perf_counter() - start)


def python_rate(dataset, programs) -> float:
    from kspipe.datafeed import python_batches

    exe, scope = fresh(programs)
    start = time.perf_counter()
    seen = 0
    for feed in python_batches(
        dataset.train_files, dataset.desc, dataset.batch_size, dict(dataset.dense_width)
    ):
        exe.run(programs.main, feed=feed, fetch_list=[programs.loss], scope=scope)
        seen += len(feed["dense"])
    return seen / (time.perf_counter() - start)


def measure(folder: str, batch_size: int, feeding: str) -> float:
    """One run's samples/s: ``python``, or ``threads=N`` for train_from_dataset."""
    from kspipe.datafeed import scan_files

    dataset, programs = build(folder, batch_size)
    dataset.train_counts = scan_files(dataset.train_files, dataset.desc, check=False)
    if feeding == "python":
        return python_rate(dataset, programs)
    return dataset_rate(dataset, programs, int(feeding.split("=")[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--lines-per-file", type=int, default=25000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="also run the whole experiment locally and on a 2-worker cluster",
    )
    parser.add_argument(
        "--pipeline-only",
        action="store_true",
        help="only the whole experiment, locally and on a 2-worker cluster",
    )
    parser.add_argument(
        "--measure", nargs=2, metavar=("FOLDER", "FEEDING"), help=argparse.SUPPRESS
    )  # one measurement, in a process of its own
    args = parser.parse_args()
    if args.measure:
        print(measure(args.measure[0], args.batch_size, args.measure[1]))
        return

    from kspipe.datafeed import generated as ctr_data

    def rate(folder: str, feeding: str) -> float:
        # A process per run: Paddle 2.6.2 keeps trainer state per process, and a second
        # train_from_dataset with another thread count aborts (multi_trainer.cc:138)
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--batch-size",
                str(args.batch_size),
                "--measure",
                folder,
                feeding,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return float(out.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as folder:
        ctr_data.generate(folder, args.files, 1, args.lines_per_file, seed=0)
        print(
            f"{platform.machine()}, {os.cpu_count()} cores; {args.files * args.lines_per_file} "
            f"instances in {args.files} files, batch {args.batch_size}"
        )
        if not args.pipeline_only:
            feeding_rows(folder, args.repeats, rate)
        if args.pipeline or args.pipeline_only:
            pipeline_rows(folder, args.repeats)


def feeding_rows(folder: str, repeats: int, rate) -> None:
    """samples/s of one epoch fed from Python and by 1 and 2 reader threads."""
    python = max(rate(folder, "python") for _ in range(repeats))
    rows = [("python-fed (parse + Executor.run)", python)]
    for threads in (1, 2):
        best = max(rate(folder, f"threads={threads}") for _ in range(repeats))
        rows.append((f"train_from_dataset, {threads} thread(s)", best))
    print(f"{'feeding':<38} {'samples/s':>10} {'vs python':>10}")
    for name, value in rows:
        print(f"{name:<38} {value:>10.0f} {value / python:>9.2f}x")
    print(f"kspipe's check of every line before training: {check_seconds(folder):.2f} s")


PIPELINES = (("mode=local", []), ("mode=pserver workers=2", ["mode=pserver", "workers=2"]))


def pipeline_rows(folder: str, repeats: int) -> None:
    """The whole experiment locally and on the cluster, ``repeats`` times each, alternating
    (so both see the same load of the machine); the best rate of each, every run's AUC."""
    runs = {name: [] for name, _ in PIPELINES}
    for _ in range(repeats):
        for name, overrides in PIPELINES:
            metrics = run_experiment(folder, overrides)
            runs[name].append((metrics["samples_per_s"], metrics["test_auc"]))
    local = max(r for r, _ in runs["mode=local"])
    print(f"{'whole experiment, 2 epochs':<38} {'samples/s':>10} {'vs local':>10}  test AUC")
    for name, results in runs.items():
        best = max(r for r, _ in results)
        aucs = ", ".join(f"{auc:.3f}" for _, auc in results)
        print(f"{name:<38} {best:>10.0f} {best / local:>9.2f}x  {aucs}")
        print(f"{'':<38} {'(runs: ' + ', '.join(f'{r:.0f}' for r, _ in results) + ')'}")


def run_experiment(folder: str, overrides: list[str]) -> dict:
    """``kspipe +experiment=ctr_datafeed`` on these files (pserver: a loopback cluster)."""
    from kspipe.pipeline import run
    from kspipe.testing import compose_config, plugin_manager

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose_config(
            [
                "+experiment=ctr_datafeed",
                f"datafeed.desc={folder}/ctr.prototxt",
                f"datafeed.train_files={folder}/train",
                f"datafeed.test_files={folder}/test",
                f"run_dir={run_dir}",
                "tracking.enabled=false",
                "cluster.timeout_s=1200",
                *overrides,
            ]
        )
        return run(cfg, plugin_manager())


def check_seconds(folder: str) -> float:
    """Seconds :func:`kspipe.datafeed.scan_files` takes to check the training files."""
    import glob

    from kspipe.datafeed import DataFeedDesc, scan_files

    desc = DataFeedDesc(os.path.join(folder, "ctr.prototxt"))
    start = time.perf_counter()
    scan_files(sorted(glob.glob(os.path.join(folder, "train", "*"))), desc, label="label")
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
