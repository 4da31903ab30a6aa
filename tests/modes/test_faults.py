"""The fault campaign's short form (bench/faults.py; its full run is in BENCHMARKS.md,
"Faults"): two seeded trials of the sync job, one with restarts left and one without, each
a process killed, stopped or a checkpoint removed at a random moment of the job's life, and
each outcome checked (the uninterrupted job's parameters bit for bit and one FINISHED run,
or one FAILED run in one line naming the process, and nothing left running)."""

import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def test_a_seeded_handful_of_faults_ends_as_promised(tmp_path):
    trials = tmp_path / "trials.json"
    result = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "bench" / "faults.py"),
            "--trials=2",
            "--seed=1",
            "--kinds=sync",
            f"--json={trials}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trials passed, 0 missed" in result.stdout, result.stdout[-3000:]
    assert "2 of 2 trials passed" in result.stdout, result.stdout[-3000:]
