"""A Ctrl-C while the ``kspipe`` command starts, before its job begins, as a terminal
sends it (to the command's process group): one line, exit 130, no traceback from the
command nor from its MLflow recorder, and no process left behind.

The signal is sent at moments found by watching the command: 30 ms after the recorder
process appears (Python is starting in it, its signals not yet set aside, and the
command is composing its config), and while Paddle's library is loading (an import that
a KeyboardInterrupt cuts leaves "ImportError: initialization failed").  Paddle's core
installs handlers of its own midway through its import (SIGTERM's prints a "FatalError"
dump): they are never in place when its next module imports."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kspipe.testing import tiny_overrides


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid
            ):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def recorder_started(pid: int) -> bool:
    for child in children(pid):
        try:
            command_line = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"kspipe.observers.mlflow.record" in command_line:
                return True
        except OSError:
            continue
    return False


def paddle_loading(pid: int) -> bool:
    try:
        return "libpaddle" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize(
    "moment, then, stop",
    [
        (recorder_started, 0.03, signal.SIGINT),
        (paddle_loading, 0, signal.SIGINT),
        (paddle_loading, 0, signal.SIGTERM),
    ],
)
def test_a_stop_before_the_job_is_one_line(tmp_path, tiny_data, moment, then, stop):
    mark = f"KSPIPE_TEST_MARK=stop-{moment.__name__}-{stop}-{os.getpid()}"
    command = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspipe",
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, **dict([mark.split("=", 1)])),
    )
    try:
        deadline = time.monotonic() + 60
        while not moment(command.pid):
            assert command.poll() is None and time.monotonic() < deadline, (
                f"never saw {moment.__name__}"
            )
            time.sleep(0.002)
        time.sleep(then)
        os.killpg(command.pid, stop)
        out, _ = command.communicate(timeout=120)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    assert command.returncode == 128 + stop, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "FatalError" not in out, out
    assert (
        out.strip().splitlines()[-1]
        == f"kspipe: error: stopped by {stop.name} before the job began"
    ), out
    time.sleep(0.5)  # the recorder is killed as the command exits
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if marked(pid, mark)]
    assert left == []
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def marked(pid: int, mark: str) -> bool:
    try:
        return mark.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def test_paddles_signal_handlers_are_off_from_its_next_module_on():
    """While :func:`kspipe.process.stopping.install` imports Paddle, its handlers (glog's: SIGTERM's
    "FatalError" dump, and SIGSEGV's, which Python never handles) are off again before
    each of Paddle's modules imports; afterwards kspipe's handle SIGTERM and SIGINT."""
    check = (
        "import importlib.abc, signal, sys\n"
        "from kspipe.process import stopping\n"
        "def caught():\n"
        "    status = open('/proc/self/status').read()\n"
        "    mask = int(status.split('SigCgt:')[1].split()[0], 16)\n"
        "    return {s for s in (signal.SIGSEGV, signal.SIGTERM, signal.SIGINT)\n"
        "            if mask & 1 << (s - 1)}\n"
        "seen = []\n"
        "class Check(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if signal.SIGSEGV in caught():\n"
        "            seen.append(name)\n"
        "sys.meta_path.insert(0, Check())  # after install's own\n"
        "stopping.install()\n"
        "assert 'paddle' in sys.modules\n"
        "print(len(seen), sorted(caught()) == [signal.SIGINT, signal.SIGTERM],\n"
        "      signal.getsignal(signal.SIGTERM) is stopping._handle)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["0", "True", "True"]
