"""Processes around a test's job: those of the job still running, a command stopped as a
user stops it, and a machine kept busy."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def environment_of(pid: int) -> dict:
    """Process ``pid``'s environment ({} once it has gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def job_processes(run_dir) -> list[int]:
    """The processes of the job whose run folder is ``run_dir`` that are still running
    (every role kspipe's launchers start runs ``kspipe.cli.worker <run_dir>``)."""
    out = subprocess.run(
        ["pgrep", "-f", f"kspipe.cli.worker {run_dir}"], capture_output=True, text=True
    ).stdout.split()
    return [int(pid) for pid in out if int(pid) != os.getpid()]


def role_pid(run_dir, role: str, index: int, step: bool = False) -> int | None:
    """The pid of the job's worker ``index``, or of its server (it has one), if it runs
    (``step``: the role itself, not the ``srun`` that started it)."""
    for pid in job_processes(run_dir):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if step and Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"srun"):
                continue
        except OSError:
            continue
        server = b"TRAINING_ROLE=PSERVER" in env  # a server has a PADDLE_TRAINER_ID too
        worker = not server and f"PADDLE_TRAINER_ID={index}".encode() in env
        if server if role == "server" else worker:
            return pid
    return None


def stopped_when(
    process, ready, timeout: float, signum: int = signal.SIGINT, within: float = 60.0
) -> str:
    """Send ``process`` (a ``Popen`` with text pipes) the signal ``signum`` (by default a
    user's Ctrl-C) once ``ready()`` holds, and return its standard error once it has ended;
    it fails if ``process`` ends first, ``ready()`` takes over ``timeout`` seconds, or
    ``process`` takes over ``within`` seconds to end after the signal."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert time.monotonic() < deadline and process.poll() is None, process.communicate()
            time.sleep(0.05)
        process.send_signal(signum)
        sent = time.monotonic()
        stderr = process.communicate(timeout=max(60.0, within))[1]
        assert time.monotonic() - sent < within, f"it ended {within} s or more after the signal"
        return stderr
    finally:
        if process.poll() is None:
            process.kill()


@contextlib.contextmanager
def overloaded(processes: int = 3, seconds: int = 600):
    """More busy processes than a 2-core machine has cores, while the block runs; each is
    ended when the block ends, and by itself after ``seconds`` at the latest."""
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


def wait_until(condition, timeout: float, what, poll: float = 0.5) -> None:
    """Wait until ``condition()``; fail with ``what()`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(poll)
