"""The recorder: a process of its own that writes a run's record into the MLflow store
(:mod:`kspipe.observers.mlflow.record`); here, the job's side of it.

The job's process starts it when the run starts (:meth:`Recorder.start`) and goes on at
once: importing MLflow and opening its store (2-4 s) run on another core, beside
Paddle's import, the data set and the programs, and the training process never imports
MLflow nor waits for SQLite.  Requests go through a pipe in the order they are made; the
ones that need an answer (the run's id, its end) wait for it, the others (metrics,
artifacts) do not.

A ``kspipe`` command that may record its run starts the recorder first thing
(:func:`start_early`), so that MLflow's import (2-4 s) runs beside the config's
composition and Paddle's import too; once the config says where the run goes, the
recorder imports that store's modules (:func:`prepare_early`), or, for a run that records
nothing, ends (:func:`end_early`).  The run takes that recorder (:meth:`Recorder.take`).

If the job's process dies, even by SIGKILL, the pipe closes and the recorder ends the run
it made FAILED: no run is left RUNNING.  The command's recorder is a session of its own,
which a terminal's Ctrl-C does not reach, and every recorder ignores SIGINT and SIGTERM (a
scheduler's preemption signals every process of the job): the job's process decides how
the run ends and says so.  If the recorder dies, the job goes on, unrecorded, and says so
in one line.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from multiprocessing.connection import Connection

#: the recorder process's module (:mod:`kspipe.observers.mlflow.record`)
PROCESS = "kspipe.observers.mlflow.record"


class Recorder:
    """The job's side of the pipe to the recorder process."""

    def __init__(self, process: subprocess.Popen, requests: Connection, answers: Connection):
        self.process, self.requests, self.answers = process, requests, answers
        self.waiting = 0  # answers asked for and not yet read

    @classmethod
    def start(cls) -> "Recorder":
        """A recorder process, with the job's import path (a plugin's predictor module
        must import there too) and its working folder (MLflow's ``./mlruns``); it imports
        MLflow while it waits for its first request.  The command's recorders
        (:func:`start_early`) are sessions of their own: a terminal's Ctrl-C, which reaches
        the command's process group, never reaches them, not even before they have set
        their signals aside.  A launched worker's is in the worker's session, which the
        launcher stops whole."""
        to_child, requests = os.pipe()
        answers, from_child = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", PROCESS, str(to_child), str(from_child)],
                pass_fds=(to_child, from_child),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=_own_sessions,
            )
        finally:
            os.close(to_child)
            os.close(from_child)
        return cls(
            process, Connection(requests, readable=False), Connection(answers, writable=False)
        )

    @classmethod
    def take(cls) -> "Recorder":
        """The recorder :func:`start_early` started, if it is still there; else a new one."""
        global _early
        recorder, _early = _early, None
        if recorder is not None and recorder.process.poll() is None:
            return recorder
        if recorder is not None:
            recorder.close()
        return cls.start()

    def send(self, request: str, *args) -> None:
        """Ask for ``request`` without waiting for it (its error, if any, is said by the
        recorder)."""
        self.requests.send((request, args, False))

    def ask(self, request: str, *args) -> None:
        """Ask for ``request``; :meth:`answer` waits for what it returns."""
        self.requests.send((request, args, True))
        self.waiting += 1

    def answer(self):
        """The oldest answer asked for: its result, or its error raised here
        (:class:`EOFError` if the recorder died)."""
        if self.waiting == 0:
            raise RuntimeError("no answer was asked for")
        while not self.answers.poll(1):
            if self.process.poll() is not None and not self.answers.poll():
                raise EOFError(f"the recorder process ended ({self.process.returncode})")
        self.waiting -= 1
        result, error = self.answers.recv()
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        """End the pipe and wait for the process (it has nothing left to do)."""
        for end in (self.requests, self.answers):
            end.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_early: Recorder | None = None  # started by start_early, not yet taken by a run
_own_sessions = False  # this process is a command: its recorders get sessions of their own


def start_early() -> None:
    """Start the recorder that this process's first run will take; it imports MLflow at
    once.  If no run takes it (the job handed to a scheduler, or stopped before its run
    began), it is ended with this process, having made nothing: it must not outlive the
    command, holding its output open."""
    global _early, _own_sessions
    if _early is None:
        _own_sessions = True
        atexit.register(end_early)  # first: a stop at any time after leaves nothing running
        _early = Recorder.start()


def prepare_early(uri: str) -> None:
    """The recorder :func:`start_early` started imports what a store at ``uri`` needs (a
    recorder that died meanwhile is ended: the run will start another)."""
    if _early is not None:
        try:
            _early.send("prepare", uri)
        except OSError:
            end_early()


def end_early() -> None:
    """End the recorder :func:`start_early` started, if no run took it."""
    global _early
    recorder, _early = _early, None
    if recorder is not None:
        recorder.process.kill()  # it ignores SIGTERM, and it has nothing to write
        recorder.process.wait()
        recorder.close()
