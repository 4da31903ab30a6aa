"""A ``kspipe`` command killed outright (SIGKILL: the OOM killer, ``kill -9``) leaves none
of its job's processes running, whichever launcher started them: kspipe's own, whose
roles die with it, and Paddle's, which puts each role in a session of its own, and whose
roles (it leaves them running when it is killed) now die with it, as it dies with the
command."""

import os
import signal
import subprocess
import sys
import time

import pytest

from kspipe.testing import tiny_overrides
from tests.kit import job_processes


@pytest.mark.parametrize("launcher", ["processes", "paddle"])
def test_a_command_killed_outright_leaves_no_role_running(tmp_path, tiny_data, launcher):
    run_dir = tmp_path / "run"
    command = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspipe",
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "train.meta_iters=100000",  # hours: it is still training when killed
            "mode=pserver",
            "workers=2",
            f"cluster.launcher={launcher}",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while len(job_processes(run_dir)) < 3:  # the server and the two workers
            assert command.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        command.kill()  # the command alone, as the OOM killer does
        command.wait()
        deadline = time.monotonic() + 15
        while job_processes(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job_processes(run_dir) == []
    finally:
        for pid in job_processes(run_dir):
            os.kill(pid, signal.SIGKILL)
        if command.poll() is None:
            command.kill()
