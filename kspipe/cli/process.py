"""The process a ``kspipe`` command or a launched worker runs in: how it is set up, first
thing, and how it ends when the command cannot go on.

Nothing here runs at import: the entry points call :func:`prepare_process` before they
import Paddle or start a thread (:func:`kspipe.cli.command.main`,
:func:`kspipe.cli.worker.main`).
"""

from __future__ import annotations

import os
import sys

from kspipe.cluster.environment import share_cores
from kspipe.errors import KspipeError, print_error
from kspipe.process.memory import cap_arenas, executor_defaults

#: Paddle's C++ log: warnings and errors only, unless the user set it
QUIET_LOG = {"GLOG_minloglevel": "2"}


def prepare_process(role: bool, env=os.environ) -> None:
    """Set this process up as kspipe runs a job, each unless the user set it in ``env``:
    Paddle's C++ log quiet (:data:`QUIET_LOG`); glibc's malloc arenas capped at the cores
    (:func:`kspipe.process.memory.cap_arenas`: before any thread starts); Paddle's executor as
    kspipe runs it (:func:`kspipe.process.memory.executor_defaults`: before Paddle loads); and for
    a process that plays a ``role`` in a job (a launched worker, or a command a scheduler
    started as one), OpenMP's threads that share the host's cores with the job's other
    processes (:func:`kspipe.cluster.environment.share_cores`: before Paddle loads OpenMP).
    """
    for name, value in QUIET_LOG.items():
        env.setdefault(name, value)
    cap_arenas(env)
    executor_defaults(env)
    if role:
        share_cores(env)


def fail(err: KspipeError) -> None:
    """End the command with ``err`` in one line (``kspipe: error: ...``) and its exit code."""
    print_error(err)
    sys.exit(err.exit_code)


def reader_gone() -> None:
    """The reader of the command's output is gone (``kspipe ... | head``): exit as a
    shell's own commands do, silently."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
    sys.exit(141)  # 128 + SIGPIPE
