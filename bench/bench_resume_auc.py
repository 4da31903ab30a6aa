"""ctr resumed on a parameter-server cluster against ctr uninterrupted: test AUC, many runs.

    python bench/bench_resume_auc.py [--pairs 6] [--workers 2] [--servers 2]

Async training does not repeat (Hogwild threads, pushes sent on the client's timer), so one
resumed run cannot be compared with one uninterrupted run.  For each of ``--pairs`` pairs:
one epoch (its checkpoint holds the servers' tables), that run resumed to two epochs, and
two epochs uninterrupted, all on the tests' generated set (4 files of 5,000 lines).  Prints
every test AUC, the mean and standard deviation of each kind, and the difference of the
means with its standard error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SMALL = [
    "datafeed.generated.train_files=4",
    "datafeed.generated.test_files=1",
    "datafeed.generated.lines_per_file=5000",
    "tracking.enabled=false",
]


def run(folder: Path, name: str, *overrides) -> float:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "+experiment=ctr_datafeed",
            "mode=pserver",
            f"datafeed.generated.cache_dir={folder / 'cache'}",
            *SMALL,
            f"run_dir={folder / name}",
            *overrides,
        ],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads((folder / name / "metrics.json").read_text())["test_auc"]


def summary(values: list) -> str:
    return f"mean {statistics.mean(values):.4f}, sd {statistics.stdev(values):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args()
    cluster = [f"workers={args.workers}", f"servers={args.servers}"]
    one, resumed, whole = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print(f"ctr, {args.workers} workers, {args.servers} servers: test AUC")
        for i in range(args.pairs):
            one.append(run(folder, f"one-{i}", *cluster, "ctr.epochs=1"))
            resumed.append(
                run(
                    folder,
                    f"resumed-{i}",
                    *cluster,
                    "ctr.epochs=2",
                    f"resume={folder / f'one-{i}'}",
                )
            )
            whole.append(run(folder, f"whole-{i}", *cluster, "ctr.epochs=2"))
            print(
                f"  pair {i}: one epoch {one[-1]:.4f}, resumed to two {resumed[-1]:.4f}, "
                f"two uninterrupted {whole[-1]:.4f}",
                flush=True,
            )
    print(f"one epoch:             {summary(one)}")
    print(f"resumed to two:        {summary(resumed)}")
    print(f"two uninterrupted:     {summary(whole)}")
    difference = statistics.mean(resumed) - statistics.mean(whole)
    error = (
        statistics.variance(resumed) / len(resumed) + statistics.variance(whole) / len(whole)
    ) ** 0.5
    print(f"resumed - uninterrupted: {difference:+.4f} (standard error {error:.4f})")


if __name__ == "__main__":
    main()
