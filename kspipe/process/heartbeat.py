"""Where a process of a cluster job is, for the launcher that watches it: a small file it
reads to find a process that makes no progress (:mod:`kspipe.launchers.stalls`).

The code that makes progress says so: the pipeline as each stage begins, the reporter at
each step (:meth:`kspipe.reporting.Reporter.progress`), the roles and exchanges as they
begin and end a wait on other processes (:func:`phase`).  A thread writes what they said
to ``<logs>/<role>.<index>.progress`` at most once a second, and only when it changed: the
file says how far the process got, never merely that it runs, so a process stuck in an
exchange, a loop or a C++ call leaves its file as it was, and its launcher sees that.

The launcher sets :data:`DIR_ENV` (its logs folder) for every process it starts; the
process names its file by the role Paddle's environment gives it, so it works the same
under Paddle's launcher and Slurm's steps.  Without it (a local run) nothing is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading

DIR_ENV = "KSPIPE_PROGRESS_DIR"
SUFFIX = ".progress"
EVERY_S = 1.0


class _State:
    """What the process last said (attributes set by the threads that make progress)."""

    def __init__(self, name: str, path: str):
        self.path, self.written = path, -1
        self.lock = threading.Lock()  # one writer of the file at a time
        self.fields = {
            "name": name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "beats": 0,  # how many times it said something new
            "task": None,
            "step": None,
            "phase": "setting up",
            "waiting": False,  # in a wait on other processes
            "serving": False,  # a server's loop: it blocks in C++ and says nothing more
            "ended": False,
        }

    def say(self, **changes) -> None:
        self.fields.update(changes)
        self.fields["beats"] += 1

    def write(self) -> None:
        with self.lock:
            fields = dict(self.fields)
            if fields["beats"] == self.written:
                return
            tmp = self.path + ".tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(fields, f)
                os.replace(tmp, self.path)
            except OSError:  # a full disk: the launcher goes without (the job's writes fail)
                return
            self.written = fields["beats"]


_state: _State | None = None
_stop = threading.Event()


def own_name(env=os.environ) -> str | None:
    """This process's name in its job (``worker 1``, ``server 0``) from Paddle's
    environment contract (kspipe/cluster/environment.py), or None outside a job."""
    if env.get("TRAINING_ROLE") == "PSERVER":
        servers = env.get("PADDLE_PSERVERS_IP_PORT_LIST", "").split(",")
        own = f"{env.get('POD_IP')}:{env.get('PADDLE_PORT')}"
        return f"server {servers.index(own) if own in servers else 0}"
    index = env.get("PADDLE_TRAINER_ID")
    return f"worker {int(index)}" if index is not None and index.isdigit() else None


def path_of(folder: str, name: str) -> str:
    return os.path.join(folder, name.replace(" ", ".") + SUFFIX)


def start(env=os.environ) -> None:
    """Begin this process's file (``setting up``) if its launcher asked for one."""
    global _state
    folder, name = env.get(DIR_ENV), own_name(env)
    if not folder or name is None or _state is not None:
        return
    _state = _State(name, path_of(folder, name))
    _state.write()
    threading.Thread(target=_writer, name="kspipe-heartbeat", daemon=True).start()


def _writer() -> None:
    while not _stop.wait(EVERY_S):
        state = _state
        if state is not None:
            state.write()


def end() -> None:
    """The process leaves: its file says so, and no more is written."""
    global _state
    state, _state = _state, None
    _stop.set()
    if state is not None:
        state.say(ended=True, phase="ended")
        state.write()


def step(task: str, number: int) -> None:
    """A step of ``task`` done (a step reported again is no progress)."""
    state = _state
    if state is not None and (state.fields["task"], state.fields["step"]) != (task, number):
        state.say(task=task, step=number)


def serving() -> None:
    """A server enters its loop, which holds the interpreter: written now, and its launcher
    watches it from outside (whether it is stopped) from then on."""
    state = _state
    if state is not None:
        state.say(phase="serving", serving=True, waiting=False)
        state.write()


@contextlib.contextmanager
def phase(what: str, waiting: bool = False):
    """The process does ``what`` (``waiting``: it waits on other processes) until the block
    ends; entering and leaving are both progress, and the phase before comes back."""
    state = _state
    if state is None:
        yield
        return
    before = (state.fields["phase"], state.fields["waiting"])
    state.say(phase=what, waiting=waiting)
    try:
        yield
    finally:
        state.say(phase=before[0], waiting=before[1])
