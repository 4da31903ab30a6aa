"""``cluster.stall_seconds``: a process of a cluster job that makes no progress for that long
counts as failed, and its launcher stops the job, saying in one line which process and what
it was doing.

Each process writes how far it got to ``<logs>/<role>.<index>.progress``
(:mod:`kspipe.process.heartbeat`): its steps, and the phase it is in, including the waits on other
processes (a sync round's sum, a barrier, a pull from the servers).  :class:`StallWatch`
reads those files once a second in the launcher (kspipe/launchers/watcher.py
:meth:`~kspipe.launchers.watcher.Cluster.wait`, and Paddle's launcher's watch), and notes
when each one last changed.  A process is stalled when it has been stopped for
``stall_seconds`` (``/proc/<pid>/stat`` says ``T``, SIGSTOP or SIGTSTP, or ``t``, a
debugger; seen for a process on this host: a parameter server, which blocks in Paddle's C++
loop and writes nothing once it serves, is judged by this alone), or when it has made no
progress for ``stall_seconds`` and

* it is not waiting on other processes (stuck in its own work: a step, an evaluation, a
  checkpoint, setting up); or
* it waits, and no process of the job made progress in that time either (a deadlock, or
  everyone waits on servers that do not answer).

A process that waits while another works (a worker at a barrier while the first one
evaluates) is not stalled.  Where several are, a stopped one is named first (it is the
cause), then one stuck in its own work, then the one idle longest.  A process on another
host (a Slurm step on another node) is judged by its file, if the run folder is shared.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

from kspipe.errors import Stalled
from kspipe.process.heartbeat import SUFFIX, path_of

CHECK_EVERY_S = 1.0


def state(pid: int) -> str | None:
    """The state letter of process ``pid`` on this host (``R``, ``S``, ``T`` ...), or None if
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_stopped(pid: int) -> bool:
    return state(pid) in ("T", "t")


def clear(log_dir: str, processes: list) -> None:
    """Remove the progress files of ``processes`` (``(role, index)``: this host's) from
    ``log_dir``, once they have ended: they say how far a running process got, and the logs
    are the run's record.  Another host's, in a run folder they share, are its own."""
    for role, index in processes:
        path = path_of(log_dir, f"{role} {index}")
        for name in (path, path + ".tmp"):
            try:
                os.remove(name)
            except OSError:
                pass


def forget(log_dir: str, role: str, index: int) -> None:
    """Remove what a process of an earlier start of this job left at the path of
    ``<role> <index>``'s file."""
    try:
        os.remove(path_of(log_dir, f"{role} {index}"))
    except OSError:
        pass


class Seen:
    """A process's file as the launcher last read it, and when it last changed."""

    def __init__(self, fields: dict, now: float):
        self.fields, self.changed, self.stopped_since = fields, now, None


def unwritten(name: str, pid: int, host: str) -> dict:
    """The fields of a process that has written no file yet: judged as a server is, by its
    state alone (stopped or not), not by its progress."""
    return dict(name=name, pid=pid, host=host, phase="starting", step=None, task=None,
                waiting=False, serving=True, ended=False, beats=0)  # fmt: skip


class StallWatch:
    """The files of ``log_dir``, judged every :data:`CHECK_EVERY_S` (``clock``, ``states``
    and ``host`` are the time, ``/proc`` and this host's name, for the tests)."""

    def __init__(self, log_dir: str, limit_s: float, clock=time.monotonic, states=state, host=None):
        self.log_dir, self.limit_s = log_dir, float(limit_s)
        self.clock, self.states = clock, states
        self.host = host or socket.gethostname()
        self.seen: dict[str, Seen] = {}
        self.checked = None

    def check(self, running: dict | None = None, log_of=None, pids=None) -> Stalled | None:
        """The stall of the job, if any.  ``running``: this launcher's processes by name,
        whether each still runs (for those on other hosts); ``log_of(name)``: a log;
        ``pids``: this launcher's processes by name, their pids (one stopped before it
        wrote its file is judged by its state alone)."""
        now = self.clock()
        if self.checked is not None and now - self.checked < CHECK_EVERY_S:
            return None
        self.checked = now
        self._read(now)
        for name, pid in (pids or {}).items():
            if path_of("", name) not in self.seen:  # no file yet: its state alone says
                self.seen[path_of("", name)] = Seen(unwritten(name, pid, self.host), now)
        live = [s for s in self.seen.values() if self._alive(s, running)]
        for s in live:
            here = s.fields["host"] == self.host
            if here and self.states(s.fields["pid"]) in ("T", "t"):
                s.stopped_since = now if s.stopped_since is None else s.stopped_since
            else:
                s.stopped_since = None
        beating = [s for s in live if not s.fields["serving"]]
        job_idle = now - max((s.changed for s in beating), default=now)
        stalled = [
            s
            for s in beating
            if now - s.changed > self.limit_s
            and (not s.fields["waiting"] or job_idle > self.limit_s)
        ]
        stopped = [s for s in live if s.stopped_since is not None]
        if not stalled and not any(now - s.stopped_since > self.limit_s for s in stopped):
            return None
        if stopped:
            cause = max(stopped, key=lambda s: now - s.stopped_since)
        else:
            cause = max(stalled, key=lambda s: (not s.fields["waiting"], now - s.changed))
        log = log_of(cause.fields["name"]) if log_of else None
        return self._error(cause, now, job_idle, log)

    def kill_stopped(self) -> None:
        """SIGKILL every stopped process of the job on this host (SIGTERM waits for a
        SIGCONT), with its process group."""
        for s in self.seen.values():
            pid = s.fields["pid"]
            if s.fields["host"] == self.host and self.states(pid) in ("T", "t"):
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass

    def _read(self, now: float) -> None:
        try:
            names = [n for n in os.listdir(self.log_dir) if n.endswith(SUFFIX)]
        except OSError:
            return
        for name in names:
            try:
                with open(os.path.join(self.log_dir, name)) as f:
                    fields = json.load(f)
            except (OSError, ValueError):
                continue  # being replaced: next time
            before = self.seen.get(name)
            if before is None:
                self.seen[name] = Seen(fields, now)
            elif (fields["pid"], fields["beats"]) != (before.fields["pid"], before.fields["beats"]):
                before.fields, before.changed = fields, now

    def _alive(self, s: Seen, running: dict | None) -> bool:
        if s.fields["ended"]:
            return False
        if s.fields["host"] == self.host:
            return self.states(s.fields["pid"]) not in (None, "Z", "X")
        return (running or {}).get(s.fields["name"], True)

    def _error(self, s: Seen, now: float, job_idle: float, log: str | None) -> Stalled:
        f = s.fields
        where = f["phase"]
        if f["step"] is not None:
            where = f"last {f['task']} step {f['step']}, {where}"
        idle = now - s.changed
        if s.stopped_since is not None:
            why = "SIGSTOP or SIGTSTP" if self.states(f["pid"]) == "T" else "by a debugger"
            said = f"{f['name']} has been stopped ({why}) for {now - s.stopped_since:.0f} s"
        else:
            said = f"{f['name']} made no progress for {idle:.0f} s"
            if f["waiting"] and job_idle > self.limit_s:
                said += ", nor did any other process of the job"
        where += f"; cluster.stall_seconds={self.limit_s:g}"
        return Stalled(f"{said} ({where})" + (f"; its log: {log}" if log else ""))
