"""The reference the tests of jobs that others start compare with: the tiny job of
``kspipe.testing.SCHEDULED_JOB`` started by kspipe's own launcher, and its weights."""

import subprocess
import sys

import pytest

from kspipe.testing import latest_weights, scheduled_overrides


@pytest.fixture(scope="session")
def launched(tmp_path_factory, tiny_data):
    """The tiny scheduled job trained by kspipe's own launcher: its final weights, which
    every other way of starting the same job must reach bit for bit."""
    tmp = tmp_path_factory.mktemp("launched")
    result = subprocess.run([sys.executable, "-m", "kspipe.cli",
                             *scheduled_overrides(tmp, tiny_data), f"run_dir={tmp / 'run'}"],
                            cwd=tmp, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return latest_weights(tmp / "run")
