"""Stopping: on request (SIGTERM, what Kubernetes, Slurm, systemd and ``timeout`` send on
preemption, and Ctrl-C), and quickly at the end (:func:`end_quickly`).

Paddle installs C++ signal handlers that print a "FatalError: Termination signal" dump and
exit 143 with nothing cleaned up.  :func:`install` removes them and raises
:class:`Preempted` instead, so a run unwinds like any failure: the launcher stops its
processes, the MLflow run ends KILLED (``Preempted`` is a ``KeyboardInterrupt``) and the
command exits ``128 + signal``.

A training loop that can stop cleanly wraps itself in :func:`deferred`: the first signal
then only asks it to stop, and the loop calls :func:`check` at its safe points (after a
meta-iteration, between evaluation tasks) to save what it has and raise there.  A second
signal raises at once.
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import os
import signal
import sys
from contextlib import contextmanager

#: A signal is the whole process's, and so is its handler: the request it records and
#: whether a loop defers it are process state, kept here (the one place).
_requested: int | None = None
_deferring = 0
_holding = False  # while Paddle imports (install): a signal is only noted, in _held
_held: int | None = None


class Preempted(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM, SIGINT)."""

    def __init__(self, signum: int, safe: bool = False):
        super().__init__(signum)
        self.signum = signum
        self.safe = safe  # raised by check() at a safe point, not in the middle of a step

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def install() -> None:
    """Replace Paddle's handlers of SIGTERM and SIGINT with :class:`Preempted` (main thread);
    this imports Paddle, whose import installs them.

    A stop that comes while Paddle imports (a second or two) is held, and raised once it
    has: raised within, it would leave Paddle half imported ("ImportError: initialization
    failed").  Paddle's core installs its handlers midway (SIGTERM's prints a "FatalError"
    dump); they are taken off again at its next module's import (:class:`_PaddleHandlers`)."""
    global _holding, _held
    handle_stop_signals()
    _holding, _held = True, None
    watch = _PaddleHandlers()
    sys.meta_path.insert(0, watch)
    try:
        import paddle

        paddle.disable_signal_handler()
    finally:
        sys.meta_path.remove(watch)
        handle_stop_signals()
        _holding = False
    if _held is not None:
        raise Preempted(_held)


class _PaddleHandlers(importlib.abc.MetaPathFinder):
    """Asked for every module Paddle's import imports: once Paddle's core is loaded, take
    its signal handlers off and put kspipe's back (cheap: a few system calls a module)."""

    def find_spec(self, name, path=None, target=None):
        core = sys.modules.get("paddle.base.core")
        if name.startswith("paddle.") and hasattr(core, "disable_signal_handler"):
            core.disable_signal_handler()
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, _handle)
        return None  # the module is found as usual


def handle_stop_signals() -> None:
    """SIGTERM and SIGINT raise :class:`Preempted` (main thread) until Paddle's import
    replaces them: :func:`install` after it."""
    global _requested
    _requested = None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _handle)


def end_quickly() -> None:
    """At its exit, the process skips the garbage collection that Python would make of
    every object Paddle, MLflow and their imports made: 2-3 s of a run's end, with nothing
    to gain (kspipe's files are closed and its runs ended before; exit handlers still run)."""
    atexit.register(gc.freeze)  # registered first, so it runs after the others


def default() -> None:
    """Let SIGTERM end this process at once (a server blocked in C++ never returns to Python)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def skip_destructors_at_exit() -> None:
    """This process's ``exit()``, with its status, skips the C++ static destructors.

    A parameter server's C++ calls ``exit(-1)`` from one of its threads when it gives up
    (a table it cannot save: a full disk).  ``exit`` runs the static destructors, and
    brpc's server waits in its own for connections that never close: the process would
    hang, and with it the job's workers, whose save request waits up to 3 hours.  No
    Python can run then (the server's main thread holds the GIL, blocked in
    ``run_server``), so the handlers are C's own: C stdio is flushed, then ``_exit`` with
    the status ``exit`` was given.  Python's exit handlers still run first, at a normal
    exit.
    """
    import ctypes

    libc = ctypes.CDLL(None)
    on_exit = getattr(libc, "on_exit", None)  # glibc's, as Paddle's wheels need
    if on_exit is None:
        return
    on_exit(libc._exit, None)  # _exit(status): the status comes first, as on_exit gives it
    libc.__cxa_atexit(libc.fflush, None, None)  # registered last, runs first: fflush(NULL)


def _handle(signum, frame) -> None:
    global _requested, _held
    if _holding:
        _held = _held or signum
        return
    if _deferring and _requested is None:
        _requested = signum
        from kspipe.reporting import say

        say(
            f"{signal.Signals(signum).name}: stopping after this step (send it again to "
            f"stop at once)"
        )
        return
    raise Preempted(signum)


@contextmanager
def deferred(enabled: bool = True):
    """Within this block a first signal only sets the request that :func:`check` raises."""
    global _deferring
    if not enabled:
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


#: How a command that a stop ended exits (:func:`exit_stopped`): ``128 + signal``.
STOPPED_EXIT_CODES = frozenset(128 + signum for signum in (signal.SIGINT, signal.SIGTERM))


def exit_stopped(stop: KeyboardInterrupt, tail: str = "") -> None:
    """Say in one line, ``stopped by <signal><tail>``, that ``stop`` (a :class:`Preempted`,
    or Python's own Ctrl-C) ended the command, and exit ``128 + signal``."""
    from kspipe.errors import print_error

    stop = stop if isinstance(stop, Preempted) else Preempted(signal.SIGINT)
    print_error(f"stopped by {stop.name}{tail}")
    sys.exit(stop.exit_code)


def requested() -> bool:
    return _requested is not None


def check() -> None:
    """Raise :class:`Preempted` if a stop was asked for (call it at a safe point)."""
    if _requested is not None:
        raise Preempted(_requested, safe=True)


#: In the environment of a job's roles that a launcher other than kspipe's own starts
#: (Paddle's, which puts each in a session of its own and leaves them running when it is
#: killed): "1" makes each role die with the process that started it (:func:`die_with_parent`).
DIE_WITH_PARENT = "KSPIPE_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Be killed (SIGKILL) when the process that started this one dies, even by SIGKILL
    (Linux; elsewhere nothing).  False if that process is gone already (this one was
    handed to init or a subreaper before it asked)."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own stop() remains
        return True
    return parent != 1 and os.getppid() == parent
