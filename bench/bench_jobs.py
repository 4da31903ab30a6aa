"""A small job's fixed costs in each mode: what a user waits for besides training.

    python bench/bench_jobs.py [--repeats 3] [--modes local,pserver,collective]

Each job is the test suite's tiny Reptile run (kspipe.testing's tiny Omniglot set and
overrides: 4 meta-iterations, a few test tasks, tracked in a new MLflow store), started as
a user starts it (``python -m kspipe.cli.command ...``): ``mode=local``, ``mode=pserver workers=2
servers=1`` and ``mode=collective workers=2``.  For each: the seconds from the command to
its ``kspipe: done`` line and to its exit (median and range over the repeats).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "local": [],
    "pserver": ["mode=pserver", "workers=2", "servers=1"],
    "collective": ["mode=collective", "workers=2"],
}


def one_job(data: Path, overrides: list[str]) -> tuple[float, float]:
    """(seconds to the ``done`` line, seconds to exit) of one tiny job."""
    from kspipe.testing import tiny_overrides

    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "+experiment=omniglot_5way",
            *tiny_overrides(Path(folder), data),
            *overrides,
        ]
        started, done = time.perf_counter(), None
        job = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=folder
        )
        for line in job.stdout:
            if line.startswith("kspipe: done"):
                done = time.perf_counter() - started
        if job.wait() != 0 or done is None:
            raise SystemExit(f"the {overrides or 'local'} job failed (exit {job.returncode})")
        return done, time.perf_counter() - started


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    from kspipe.testing import tiny_omniglot

    with tempfile.TemporaryDirectory() as root:
        data = tiny_omniglot(Path(root))
        print("| mode | to the done line | to exit | exit after done |")
        print("| --- | --- | --- | --- |")
        for mode in args.modes.split(","):
            times = [one_job(data, MODES[mode]) for _ in range(args.repeats)]
            done, ended = [t[0] for t in times], [t[1] for t in times]
            print(
                f"| {mode} | {spread(done)} | {spread(ended)} | "
                f"{spread([e - d for d, e in times])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
