"""Starting and watching the processes of a cluster (or of one host's part of it).

A mode plans its processes (:func:`kspipe.cluster.plan.launch_plan`); :class:`Cluster`
starts them, as a process launcher (:mod:`kspipe.launchers.processes`) says, and watches them;
:func:`run_cluster` is the whole of it for a job's launcher.  Each role writes
``<run_dir>/logs/<role>.<index>.log``.  Paddle's own launcher exits 0 even when workers
crash; this one watches every process and, as soon as one fails, stops the rest and
names the failed role and its log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from kspipe import checkpoint
from kspipe.errors import ClusterError
from kspipe.launchers import stalls
from kspipe.launchers.hosts import STOPPED
from kspipe.launchers.restarts import Why, error_kind, failure_kind, hang_up, tagged
from kspipe.process import stopping
from kspipe.process.heartbeat import DIR_ENV

JOB_FILE = "job.yaml"
STOP_GRACE_S = 5.0
CAUSE_GRACE_S = 2.0  # how long a failure's peers may take to exit by themselves
#: The exit of a process killed by SIGKILL (itself, or under srun, which exits 128 + 9).
KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)


def worker_command(run_dir: str, job_file: str = JOB_FILE) -> list[str]:
    """What a launched process runs: the job's stages from ``<run_dir>/<job_file>``."""
    return [sys.executable, "-u", "-m", "kspipe.cli.worker", os.path.join(run_dir, job_file)]


def job_file(hosts) -> str:
    """The name of the config this host's processes run: a job across hosts that share a
    run folder has one a host (each says which host it is, and the first host's alone
    names the MLflow run the first worker records in)."""
    return JOB_FILE if hosts is None else f"job-{hosts.here}.yaml"


@dataclass
class Process:
    role: str  # "server" or "worker"
    index: int
    popen: subprocess.Popen
    log: str
    threads: list = field(default_factory=list)
    #: its output's last ``kspipe: error:`` line and last line naming an error, kept
    #: beside its log (which a full disk may refuse) for the job's error line
    error: str | None = None
    failure: str | None = None

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"


class Cluster:
    """The processes of one job on this host; started together, stopped together."""

    def __init__(self, run_dir: str, echo_first_worker: bool = True, log_dir: str | None = None):
        self.run_dir = run_dir
        self.log_dir = log_dir or os.path.join(run_dir, "logs")
        self.processes: list[Process] = []
        self.echo_first_worker = echo_first_worker

    def start(
        self,
        role: str,
        index: int,
        env: dict,
        command: list[str] | None = None,
        cwd: str | None = None,
    ) -> Process:
        """Start one role: ``command`` (default: the job's stages, :func:`worker_command`),
        in ``cwd`` (default: the run folder, so nothing a process writes lands elsewhere)."""
        os.makedirs(self.log_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, f"{role}.{index}.log")
        log = open(log_path, "w", buffering=1)
        cmd = command or worker_command(self.run_dir)
        stalls.forget(self.log_dir, role, index)  # an earlier start's, in the same folder
        popen = subprocess.Popen(
            cmd,
            env={**env, DIR_ENV: self.log_dir},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            cwd=cwd or self.run_dir,
            preexec_fn=stopping.die_with_parent,  # even if this launcher is SIGKILLed
        )
        process = Process(role, index, popen, log_path)
        echo = self.echo_first_worker if (role == "worker" and index == 0) else False
        thread = threading.Thread(
            target=_copy_output, daemon=True, args=(popen.stdout, log, echo, process)
        )
        thread.start()
        process.threads.append(thread)
        self.processes.append(process)
        return process

    def wait(
        self, timeout_s: float | None = None, poll_s: float = 0.2, check=None, stall_s=None
    ) -> None:
        """Return when every worker exited 0 (servers are then stopped); raise on a failure,
        when ``check()`` names one elsewhere (another host's), or when a process made no
        progress for ``stall_s`` (:mod:`kspipe.launchers.stalls`)."""
        started = time.monotonic()
        watch = stalls.StallWatch(self.log_dir, stall_s) if stall_s else None
        while True:
            failure = check() if check is not None else None
            if failure:
                self.stop()
                raise tagged(ClusterError(f"{failure}{STOPPED}"), *failure_kind(failure))
            for p in self.processes:
                code = p.popen.poll()
                if code not in (None, 0):
                    raise self._failure(p, code)
            workers = [p for p in self.processes if p.role == "worker"]
            if workers and all(p.popen.poll() == 0 for p in workers):
                self._finish_servers()
                return
            if not workers and all(p.popen.poll() == 0 for p in self.processes):
                return
            stalled = watch and watch.check(
                {p.name: p.popen.poll() is None for p in self.processes},
                {p.name: p.log for p in self.processes}.get,
                {p.name: p.popen.pid for p in self.processes},
            )
            if stalled:
                watch.kill_stopped()  # also one that srun started, whose pid is not popen's
                self.stop()
                raise tagged(stalled, Why.STALLED, how=str(stalled))
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                self.stop()
                raise tagged(
                    ClusterError(
                        f"the cluster did not finish within cluster.timeout_s="
                        f"{timeout_s:g} s; logs in {self.log_dir}"
                    ),
                    Why.TIMEOUT,
                )
            time.sleep(poll_s)

    def _failure(self, failed: "Process", code: int) -> ClusterError:
        """Stop the job; the error that names why it failed.

        A process that stops on a one-line error of its own (bad config or data: its log's
        ``kspipe: error:`` line) takes its peers down with it, and one of them may exit
        first (its connection to it broke).  So the others get a moment to exit by
        themselves, and a process that did with such a line is the one named, unless one
        was killed (SIGKILL: the OOM killer, a user, a scheduler), which nothing in a job
        does to its own processes before they are stopped: its peers' lines then only say
        that it left.
        """
        deadline = time.monotonic() + CAUSE_GRACE_S
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in self.processes):
            time.sleep(0.05)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and self._cause_pending():
            time.sleep(0.05)
        exited = [p for p in self.processes if p.popen.poll() not in (None, 0)]
        self.stop()
        killed = [p for p in exited if p.popen.returncode in KILLED]
        if killed:
            return _exit_error(killed[0], killed[0].popen.returncode)
        for p in exited:
            message = p.error
            if message:
                err = ClusterError(f"{p.name}: {message} (its log: {p.log})")
                return tagged(err, error_kind(p.popen.returncode), p.name, f"stopped: {message}")
        return _exit_error(failed, code)

    def _cause_pending(self) -> bool:
        """Whether the failure's cause may still show: a process said its error and has not
        exited (its exit status tells a non-finite loss from other errors), or none said
        one and none was killed while some still run (a process says its error after its
        observers have ended, which takes seconds on a busy machine)."""
        running = [p for p in self.processes if p.popen.poll() is None]
        if any(p.error for p in running):
            return True
        told = any(p.error or p.popen.returncode in KILLED for p in self.processes)
        return bool(running) and not told

    def _finish_servers(self, grace_s: float = 30.0) -> None:
        """Servers stop when the first worker asks them to; wait, then make sure."""
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            if p.role == "server":
                while p.popen.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
        self.stop()

    def stop(self) -> None:
        """Terminate every process still running (and its children); kill after a grace,
        and at once one that is stopped (SIGSTOP: SIGTERM would wait for a SIGCONT)."""
        for p in self.processes:
            if p.popen.poll() is None:
                stopped = stalls.is_stopped(p.popen.pid)
                _signal_group(p.popen, signal.SIGKILL if stopped else signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.processes:
            while p.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGKILL)
                p.popen.wait()
            _signal_group(p.popen, signal.SIGKILL)  # anything it left behind in its group
            for thread in p.threads:
                thread.join(timeout=2)


def _signal_group(popen, sig) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


#: What of the first worker's output the launcher's terminal shows (kspipe's launcher and
#: Paddle's, kspipe/launchers/paddle.py): its messages and progress lines, not Paddle's, and
#: not its error line, which the launcher's own error repeats.
ECHOED = re.compile(r"^(kspipe: (?!error:)|[\w ()-]+ \d+/\d+ \| )")


def _copy_output(stream, log, echo: bool, process: Process) -> None:
    """Every line of a process's output into its log (and onto the terminal as ``echo``
    says), its error lines noted in ``process``.  A log or terminal that cannot be written
    (a full disk) is left: the output is still read, so the process never blocks."""
    try:
        for line in stream:
            if line.startswith("kspipe: error:"):
                process.error = line[len("kspipe: error:") :].strip()
            if line.startswith("kspipe: error:") or "Error" in line:
                process.failure = line.strip()
            if log is not None:
                try:
                    log.write(line)
                except OSError:
                    _closed(log)
                    log = None
            if echo is True and ECHOED.match(line) or echo == "all":
                try:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                except OSError:
                    echo = False
    finally:
        _closed(log)


def _closed(log) -> None:
    """Close ``log``, whose last lines a full disk may refuse."""
    if log is not None:
        try:
            log.close()
        except OSError:
            pass


def _exit_error(process, code: int) -> ClusterError:
    """A process's exit as the job's error, with its output's last error line."""
    failure = f" ({process.failure[:300]})" if process.failure else ""
    how = _describe_exit(code)
    err = ClusterError(f"{process.name} {how}; its log: {process.log}{failure}")
    return tagged(err, Why.SIGNAL if code < 0 or code > 128 else Why.EXIT, process.name, how)


def _describe_exit(code: int) -> str:
    if code in KILLED:  # srun passes its task's SIGKILL on as 128 + 9
        code = -signal.SIGKILL
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def error_line(path: str) -> str | None:
    """The message of the last ``kspipe: error:`` line of a role's log, if any."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.startswith("kspipe: error:")]
    except OSError:
        return None
    return lines[-1][len("kspipe: error:") :].strip() if lines else None


def run_cluster(cfg, reporter, plan: list, description: str, hosts=None, launcher=None) -> dict:
    """Start the processes of ``plan``, wait, return the job's metrics.

    The processes run the stages from ``<run_dir>/job.yaml``, each started as
    ``launcher`` (a :class:`kspipe.launchers.processes.ProcessLauncher`) says; the first
    worker writes ``metrics.json``.  The roles' logs become the run's ``logs`` artifacts,
    also when the job fails.  ``hosts`` (:class:`kspipe.launchers.hosts.JobHosts`): the job
    spans several hosts, whose launchers watch each other; on a host without worker 0 the
    result is ``{}`` (worker 0's host records the run).
    """
    from kspipe.launchers.hosts import HostLink

    run_dir = reporter.run_dir
    job = write_job(cfg, run_dir, job_file(hosts))
    cluster = Cluster(run_dir)
    link = HostLink(hosts, cfg.cluster.hosts_timeout_s, cfg.cluster.peer_timeout) if hosts else None
    try:
        if link:
            link.open(reporter.say)
        reporter.say(f"starting {description}; logs in {cluster.log_dir}")
        for p in plan:
            command = worker_command(run_dir, os.path.basename(job))
            cluster.start(
                p.role, p.index, p.env, launcher.command(p, command) if launcher else command
            )
        cluster.wait(
            cfg.cluster.timeout_s,
            check=link.failure if link else None,
            stall_s=cfg.cluster.get("stall_seconds"),
        )
        if link and not hosts.is_first:  # this host's part ended well; did the job?
            failure = link.outcome(cfg.cluster.timeout_s)
            if failure:
                raise tagged(ClusterError(failure), *failure_kind(failure))
    except BaseException as err:
        told = hang_up(link, err, why_stopped(err), cfg) if link else err
        cluster.stop()
        checkpoint.discard_unfinished(run_dir)  # a process stopped or killed mid-write
        # the logs a restart keeps apart: this host's own (other hosts move theirs)
        told.logs = [os.path.basename(p.log) for p in cluster.processes]
        if told is not err:
            raise told from None
        raise
    finally:
        cluster.stop()
        stalls.clear(cluster.log_dir, [(p.role, p.index) for p in cluster.processes])
        reporter.artifact(cluster.log_dir, "logs")
    if link:
        link.close()
        if not hosts.is_first:
            reporter.say(
                f"this host's part of the job finished; {hosts.first} (worker 0's "
                f"host) records the run"
            )
            return {}
    path = os.path.join(run_dir, "metrics.json")
    if not os.path.isfile(path):
        raise ClusterError(f"the job ended without results; logs in {cluster.log_dir}")
    with open(path) as f:
        return json.load(f)


def why_stopped(err: BaseException) -> str:
    """A launcher's failure, for the other hosts."""
    from kspipe.process.stopping import Preempted

    if isinstance(err, Preempted):
        return f"its launcher was stopped by {err.name}"
    return str(err) or f"its launcher was stopped ({type(err).__name__})"


def write_job(cfg, run_dir: str, name: str = JOB_FILE) -> str:
    """Write the resolved config every role of the job runs (on this host: ``name``)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, name)
    job = OmegaConf.to_container(cfg, resolve=True)
    job["run_dir"] = run_dir
    OmegaConf.save(OmegaConf.create(job), path)
    return path
