"""The fault campaign's short form (bench/faults.py; its full run is in BENCHMARKS.md,
"Faults"): two seeded trials of the sync job, one with restarts left and one without, each
a process killed, stopped or a checkpoint removed at a random moment of the job's life, and
each outcome checked (the uninterrupted job's parameters bit for bit and one FINISHED run,
or one FAILED run in one line naming the process, and nothing left running); and two across
emulated hosts sharing a run folder: a collective worker stopped midway (the stall watch of
its host finds it, the job restarts on every host and ends as one FINISHED run with the
same parameters), and a sync job's worker 1 host cut off with no restarts (one line naming
that host)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.network import unavailable

CHECKOUT = Path(__file__).resolve().parents[2]


def campaign(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKOUT / "bench" / "faults.py"), "--trials=2", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )


def test_a_seeded_handful_of_faults_ends_as_promised(tmp_path):
    result = campaign(tmp_path, "--seed=1", "--kinds=sync")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 of 2 trials passed, 0 missed" in result.stdout, result.stdout[-3000:]


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_faults_across_emulated_hosts_end_as_promised(tmp_path):
    result = campaign(tmp_path, "--seed=60", "--kinds=sync,collective", "--launcher=hosts")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 of 2 trials passed, 0 missed" in result.stdout, result.stdout[-3000:]
