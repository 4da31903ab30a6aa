"""``cluster.max_restarts``: a cluster job whose process died starts again from its own
latest checkpoint, in the same run folder and the same MLflow run.

The launcher (the ``kspipe`` command) watches the job's processes
(:func:`kspipe.launchers.watcher.run_cluster`, or Paddle's launcher under
``cluster.launcher=paddle``); a failure comes back as a :class:`ClusterError` that carries a
:class:`Failure`: which process, how it ended and why (:class:`Why`).  :func:`restarts`
decides from that alone whether starting again can help:

* a process killed by a signal, one that exited without a word, a host's launcher that went
  away or a process found hung: yes;
* a process that stopped on its own one-line error (a bad config or data, its log's
  ``kspipe: error:`` line): no, the same error would come back;
* a non-finite loss: once (a rare spike may not return from the checkpoint before it);
  the second is the job's failure;
* the job's own time limit (``cluster.timeout_s``) or a host that never came: no.

A stop of the launcher itself (SIGTERM on preemption, Ctrl-C) is no ClusterError: it ends
the job within seconds as without restarts.  :func:`launch` runs the mode's job; after a
failure it may restart, it stops the processes (the watcher already did), rewrites the
job's config to resume from the run folder's latest complete checkpoint (the servers'
tables are in it), keeps the failed attempt's logs apart and starts the job again.  With no
checkpoint yet the job starts again as it first did (from ``init_from``, if given).

A job across hosts: the first host (worker 0's, which records the run) decides and tells
the others (:mod:`kspipe.launchers.hosts`, the ``restart`` word); the others follow.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from omegaconf import open_dict

from kspipe import checkpoint
from kspipe.errors import ClusterError
from kspipe.reporting import say

#: The exit status of a job's process that stopped on a non-finite loss or metric
#: (:class:`kspipe.errors.NonFiniteError`; ``kspipe.cli.worker``): 2 is every other error.
NON_FINITE_EXIT = 4
#: The text artifact that lists the job's restarts, one line each.
RESTARTS_FILE = "restarts.txt"


class Why(enum.Enum):
    """Why a process of the job failed, as far as the launcher can tell."""

    SIGNAL = "signal"  # killed by a signal (the OOM killer, a user, a lost machine)
    EXIT = "exit"  # a non-zero exit with no error of its own
    HOST = "host"  # another host's launcher went away, or its processes failed
    STALLED = "stalled"  # a process stopped making progress
    NON_FINITE = "non-finite"  # its loss or a metric went NaN or infinite
    ERROR = "error"  # its own one-line error (config, data): a restart meets it again
    TIMEOUT = "timeout"  # cluster.timeout_s, or hosts that never met
    RESTART = "restart"  # another host: the first host restarts the job
    OTHER = "other"  # a ClusterError that says no more


#: What a restart may mend.  ``OTHER`` is in: a failure found while the processes ran
#: (whatever raised it) is a process's, not the user's.
RESTARTABLE = frozenset({Why.SIGNAL, Why.EXIT, Why.HOST, Why.STALLED, Why.OTHER})


@dataclass(frozen=True)
class Failure:
    """A failure of the job: ``process`` (``"worker 1"``; None when not one process's)
    ``how`` it ended (``"was killed by SIGKILL"``), and why (:class:`Why`)."""

    why: Why
    process: str | None = None
    how: str = ""
    start: str | None = None  # Why.RESTART: the checkpoint the first host restarts from

    def describe(self) -> str:
        if self.process:
            return f"{self.process} {self.how}".strip()
        return self.how or self.why.value


def tagged(err: ClusterError, why: Why, process: str | None = None, how: str = "", start=None):
    """``err`` carrying its :class:`Failure` (what :func:`restarts` judges)."""
    err.failure = Failure(why, process, how, start)
    return err


def error_kind(code: int) -> Why:
    """Why a process that printed its own error line ended: a non-finite value
    (:data:`NON_FINITE_EXIT`), a stop by a signal it was sent (128 + signal), else its
    error."""
    if code == NON_FINITE_EXIT:
        return Why.NON_FINITE
    return Why.SIGNAL if code < 0 or code > 128 else Why.ERROR


def failure_kind(failure: str) -> tuple:
    """What another host's failure, as its link tells it, was (see HostLink.failure)."""
    try:
        kind = Why(getattr(failure, "why", "host"))
    except ValueError:
        kind = Why.HOST
    return kind, None, str(failure)


def failure_of(err: ClusterError) -> Failure:
    """The failure ``err`` carries; an untagged ClusterError is ``OTHER``."""
    found = getattr(err, "failure", None)
    return found if isinstance(found, Failure) else Failure(Why.OTHER, how=str(err))


def restarts(failure: Failure, left: int, non_finite_before: bool) -> bool:
    """Whether the job starts again after ``failure``, with ``left`` restarts left and a
    non-finite failure met before or not (the whole decision: see the module's text)."""
    if left <= 0:
        return False
    if failure.why is Why.NON_FINITE:
        return not non_finite_before
    return failure.why in RESTARTABLE


#: The restarts of the job this launcher runs (one at a time): the watcher asks it what to
#: tell the other hosts of a failure (:func:`verdict`) before it hangs up on them.
_current: "Restarts | None" = None


class Restarts:
    """The count and the decision of one job's restarts."""

    def __init__(self, limit: int, run_dir: str):
        self.limit, self.done, self.non_finite = limit, 0, False
        self.run_dir = run_dir
        #: the checkpoint the next restart starts from, once told to other hosts (they
        #: must start from the same one); None: the run folder's latest
        self.told: str | None = None

    def decide(self, err: ClusterError) -> bool:
        return restarts(failure_of(err), self.limit - self.done, self.non_finite)


def verdict(err: BaseException) -> tuple | None:
    """What the first host tells the other hosts of ``err``: (the restart's number, the
    checkpoint it starts from, None for the job's start), or None when the job ends."""
    if _current is None or not isinstance(err, ClusterError) or not _current.decide(err):
        return None
    _current.told = latest_checkpoint(_current.run_dir) or "-"
    return _current.done + 1, None if _current.told == "-" else _current.told


def latest_checkpoint(run_dir: str) -> str | None:
    """The name of the latest complete checkpoint in ``run_dir``, if any."""
    found = sorted(checkpoint.checkpoints(os.path.join(run_dir, "checkpoints")))
    return os.path.basename(found[-1]) if found else None


def hang_up(link, err: BaseException, message: str, cfg) -> BaseException:
    """Close the job's control ``link`` after ``err`` (``message``: it for the other hosts);
    the error this host's part then ends with.  The first host says whether the job
    restarts; another host whose own processes failed waits for that word, and a restart
    it is told of becomes its error (:attr:`Why.RESTART`)."""
    failure = failure_of(err) if isinstance(err, ClusterError) else None
    first = link.hosts.is_first
    ask = (
        not first
        and failure is not None
        and failure.why is not Why.RESTART
        and int(cfg.cluster.get("max_restarts") or 0) > 0
    )
    told = verdict(err) if first else None
    link.close(
        failure=message,
        kind=failure.why.value if failure else "",
        restart=told[0] if told else None,
        start=told[1] if told else None,
        answer_s=float(cfg.cluster.hosts_timeout_s) if ask else 0.0,
    )
    if not first and link.restart is not None:
        why = f"the first host restarts the job after: {err}"
        return tagged(ClusterError(why), Why.RESTART, start=link.restart_from)
    return err


def launch(role, cfg, reporter) -> dict:
    """``role.launch(reporter)`` (the mode's job), started again after a failure as many as
    ``cluster.max_restarts`` times; the job's metrics."""
    global _current
    limit = int(cfg.cluster.get("max_restarts") or 0)
    hosts = getattr(role, "hosts", None)
    first = hosts is None or hosts.is_first
    state = Restarts(limit, os.path.abspath(reporter.run_dir))
    _current = state if first else None
    try:
        while True:
            try:
                return role.launch(reporter)
            except ClusterError as err:
                failure = failure_of(err)
                if first and not state.decide(err):
                    raise failed(err, state) from None
                if not first and failure.why is not Why.RESTART:
                    raise
                state.done += 1
                state.non_finite |= failure.why is Why.NON_FINITE
                restart(cfg, reporter, failure, state, first, getattr(err, "logs", None))
    finally:
        _current = None


def failed(err: ClusterError, state: Restarts) -> ClusterError:
    """The job's error after ``state.done`` restarts: ``err``, with its count."""
    if not state.done:
        return err
    nth = ordinal(state.done + 1)
    if state.done >= state.limit:
        tail = f"its {nth} failure, after cluster.max_restarts={state.limit} restarts"
    else:
        tail = f"its {nth} failure, which a restart cannot mend"
    return tagged(ClusterError(f"{err} ({tail})"), failure_of(err).why)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def restart(
    cfg, reporter, failure: Failure, state: Restarts, first: bool, logs: list | None = None
) -> None:
    """Set the job up to start again: its config resumes from the run folder's latest
    complete checkpoint; the failed attempt's logs (``logs``: this host's files, None:
    every file) move to ``logs/attempt-<n>``; the restart is said, counted (metric
    ``restarts``) and listed (``restarts.txt``)."""
    run_dir = state.run_dir
    checkpoint.discard_unfinished(run_dir)
    name = failure.start if not first else state.told or latest_checkpoint(run_dir)
    state.told = None
    if name and name != "-":
        path = os.path.join(run_dir, "checkpoints", name)
        if not os.path.isdir(path):  # another host's checkpoint, in a folder not shared
            raise ClusterError(
                f"the first host restarts the job from {name}, which this host's run "
                f"folder {run_dir} does not hold: restarts across hosts resume from a run "
                f"folder they share (run_dir on a shared volume)"
            )
        with open_dict(cfg):
            cfg.resume, cfg.init_from = path, None
        start = name
    else:
        start = "the beginning" if not cfg.get("init_from") else f"init_from={cfg.init_from}"
        if cfg.get("resume"):
            start = f"resume={cfg.resume}"
    keep_logs(os.path.join(run_dir, "logs"), state.done, logs)
    line = f"restart {state.done} of {state.limit} from {start}"
    if not first:
        say(f"the first host restarts the job ({line})")
        return
    say(f"{failure.describe()}; {line}")
    listing = os.path.join(run_dir, RESTARTS_FILE)
    with open(listing, "a") as f:
        f.write(f"{state.done}\t{failure.why.value}\t{failure.describe()}\t{start}\n")
    reporter.metrics({"restarts": state.done}, step=state.done)
    reporter.artifact(listing)


def keep_logs(logs: str, attempt: int, names: list | None = None) -> None:
    """Move the failed attempt's logs to ``logs/attempt-<n>``: the next attempt writes its
    own under the same names.  ``names``: the files of this host's processes, which this
    host alone moves (in a run folder that hosts share, each host restarts in its own time,
    and a host that moved another's files could move its next attempt's); None: every file
    in ``logs``."""
    if not os.path.isdir(logs):
        return
    kept = os.path.join(logs, f"attempt-{attempt}")
    os.makedirs(kept, exist_ok=True)
    if names is None:
        names = [n for n in os.listdir(logs) if os.path.isfile(os.path.join(logs, n))]
    for name in names:
        try:
            os.replace(os.path.join(logs, name), os.path.join(kept, name))
        except FileNotFoundError:  # the process never started
            pass
