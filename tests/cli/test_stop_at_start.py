"""A Ctrl-C while the ``kspipe`` command starts, before its job begins, as a terminal
sends it (to the command's process group): one line, exit 130, no traceback from the
command nor from its MLflow recorder, and no process left behind.

The signal is sent at two moments found by watching the command: 30 ms after the
recorder process appears (Python is starting in it, its signals not yet set aside, and
the command is composing its config), and while Paddle's library is loading (an import
that a KeyboardInterrupt cuts leaves "ImportError: initialization failed")."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kspipe.testing import tiny_overrides


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def recorder_started(pid: int) -> bool:
    for child in children(pid):
        try:
            if b"kspipe.observers.recorder" in Path(f"/proc/{child}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def paddle_loading(pid: int) -> bool:
    try:
        return "libpaddle" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("moment, then", [(recorder_started, 0.03), (paddle_loading, 0)])
def test_a_ctrl_c_before_the_job_is_one_line(tmp_path, tiny_data, moment, then):
    mark = f"KSPIPE_TEST_MARK=stop-{moment.__name__}-{os.getpid()}"
    command = subprocess.Popen(
        [sys.executable, "-m", "kspipe", "+experiment=omniglot_5way",
         *tiny_overrides(tmp_path, tiny_data)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=dict(os.environ, **dict([mark.split("=", 1)])))
    try:
        deadline = time.monotonic() + 60
        while not moment(command.pid):
            assert command.poll() is None and time.monotonic() < deadline, \
                f"never saw {moment.__name__}"
            time.sleep(0.002)
        time.sleep(then)
        os.killpg(command.pid, signal.SIGINT)
        out, _ = command.communicate(timeout=120)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    assert command.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.strip().splitlines()[-1] == "kspipe: error: stopped by SIGINT before the job began", out
    time.sleep(0.5)  # the recorder is killed as the command exits
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if marked(pid, mark)]
    assert left == []
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def marked(pid: int, mark: str) -> bool:
    try:
        return mark.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
