"""``cluster.launcher=paddle``: Paddle's own launcher (``python -m paddle.distributed.launch``,
fleetrun) starts the job's processes; kspipe watches them and judges how they ended.

The ``kspipe`` command is the job's launcher as under ``processes``: it records the MLflow
run and writes the job's resolved config.  Instead of starting the roles itself, it runs
Paddle's launcher (the parameter-server form, ``--server_num --trainer_num``, or the
collective one, ``--nproc_per_node``) with ``python -m kspipe.cli.worker <job.yaml>`` as its
program: each process reads its role from the environment Paddle's launcher gives it
(Paddle's contract, kspipe/job.py), and the first worker records into the command's run.

Paddle's launcher runs in ``<run folder>/logs`` (what it writes in its working folder stays
there) and writes every role's log there (``workerlog.<i>``, ``serverlog.<i>``); this
command shows worker 0's progress from its log.  Paddle's launcher exits 0 after some
failures, so its exit status is not trusted: the job succeeded when worker 0 wrote its
results and no role's log ends in an error.  And it signals a process it stops three times
in 0.4 s, where kspipe's roles take a second signal as "stop at once": when this command
is stopped (preemption) or times out, it signals each role once itself and lets them save
their checkpoints before it stops Paddle's launcher.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from kspipe import hookimpl
from kspipe.cluster.endpoints import free_ports, parse_endpoints
from kspipe.cluster.plan import Planned
from kspipe.errors import ClusterError, ConfigError
from kspipe.job import digest
from kspipe.launchers.processes import ProcessLauncher
from kspipe.launchers.restarts import Why, tagged
from kspipe.launchers.stalls import StallWatch
from kspipe.launchers.stalls import clear as clear_progress
from kspipe.launchers.watcher import ECHOED, Cluster, error_line, worker_command, write_job
from kspipe.process import stopping

#: How long the roles may take to save their state and exit when the job is stopped.
ROLES_GRACE_S = 60.0
#: Variables of the plan's environment that Paddle's launcher sets for each process itself.
PADDLE_SETS = ("TRAINING_ROLE", "POD_IP", "PADDLE_", "KSPIPE_GLOO_ENDPOINT")


class PaddleLauncher(ProcessLauncher):
    """``cluster.launcher=paddle``: the job runs under ``python -m paddle.distributed.launch``."""

    name = "paddle"

    def check(self, cfg, processes: int) -> None:
        if any(parse_endpoints(cfg.get(key), key) is not None for key in ("workers", "servers")):
            raise ConfigError(
                "cluster.launcher=paddle starts a job on this host, so workers and "
                "servers are counts; for a job across hosts, run python -m "
                "paddle.distributed.launch on each with kspipe as its program "
                '(docs/distributed.md, "Jobs a scheduler starts")'
            )

    def run(self, cfg, reporter, plan: list[Planned], description: str, hosts=None) -> dict:
        run_dir = os.path.abspath(reporter.run_dir)
        logs = os.path.join(run_dir, "logs")
        write_job(cfg, run_dir)
        cluster = Cluster(run_dir, echo_first_worker=False, log_dir=logs)
        follow = Follower(os.path.join(logs, "workerlog.0"))
        reporter.say(f"starting {description} with Paddle's launcher; logs in {logs}")
        started = time.time()
        launcher = cluster.start(
            "paddle-launch", 0, environment(plan), launch_command(plan, run_dir, logs), cwd=logs
        )
        try:
            stall_s = cfg.cluster.get("stall_seconds")
            stalls = StallWatch(logs, stall_s) if stall_s else None
            watch(launcher.popen, follow, cfg.cluster.timeout_s, logs, stalls)
        except BaseException:
            stop_roles(launcher.popen.pid)
            raise
        finally:
            cluster.stop()
            follow.echo()
            clear_progress(logs, [(p.role, p.index) for p in plan])  # this launcher's roles
            reporter.artifact(logs, "logs")
        return verdict(run_dir, logs, launcher.popen.returncode, started)


@hookimpl
def kspipe_process_launchers():
    return [PaddleLauncher()]


def launch_command(plan: list[Planned], run_dir: str, logs: str) -> list[str]:
    """Paddle's launcher's command for the job of ``plan`` (its counts; Paddle's launcher
    picks the ports)."""
    servers = sum(1 for p in plan if p.role == "server")
    workers = len(plan) - servers
    job = f"kspipe-{digest(run_dir)}"
    command = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        f"--log_dir={logs}",
        f"--job_id={job}",
    ]
    if servers:
        command += [
            f"--server_num={servers}",
            f"--trainer_num={workers}",
            f"--gloo_port={free_ports(1)[0]}",
        ]
    else:
        command += [f"--nproc_per_node={workers}"]
    return command + worker_command(run_dir)  # a program not ending in .py runs as it is


def environment(plan: list[Planned]) -> dict:
    """What the job's processes inherit: a worker's planned environment (its math threads,
    kspipe's working and log folders) without the parts Paddle's launcher sets per process."""
    worker = next(p for p in plan if p.role == "worker")
    env = {k: v for k, v in worker.env.items() if not k.startswith(PADDLE_SETS)}
    # Paddle's launcher starts each role in a session of its own: killed, it would leave
    # them running; each role dies with it instead (and it dies with this command).
    return {**env, stopping.DIE_WITH_PARENT: "1"}


def watch(launcher, follow: "Follower", timeout_s, logs: str, stalls=None) -> None:
    """Show worker 0's progress until Paddle's launcher exits; raise at ``timeout_s``, or
    when ``stalls`` (a :class:`kspipe.launchers.stalls.StallWatch`) finds a role stalled
    (a stopped one killed first: the roles are stopped with SIGTERM, which waits)."""
    deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
    while launcher.poll() is None:
        follow.echo()
        stalled = stalls and stalls.check(  # "worker 1": workerlog.1
            log_of=lambda name: os.path.join(logs, name.replace(" ", "log."))
        )
        if stalled:
            stalls.kill_stopped()
            raise tagged(stalled, Why.STALLED, how=str(stalled))
        if deadline is not None and time.monotonic() > deadline:
            raise tagged(
                ClusterError(
                    f"the job did not finish within cluster.timeout_s="
                    f"{float(timeout_s):g} s; logs in {logs}"
                ),
                Why.TIMEOUT,
            )
        time.sleep(0.2)


def stop_roles(launcher_pid: int, grace_s: float = ROLES_GRACE_S) -> None:
    """Signal each process Paddle's launcher started once (each leads a process group of its
    own) and wait until they have exited, at most ``grace_s``."""
    roles = children(launcher_pid)
    for pid in roles:
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in roles):
        time.sleep(0.1)
    for pid in roles:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended: its parent just has not read it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


class Follower:
    """Shows a role's log as it grows: kspipe's messages and progress lines."""

    def __init__(self, path: str):
        self.path, self.at = path, 0

    def echo(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.at)
                text = f.read()
        except OSError:
            return
        complete = text.rpartition(b"\n")[0]  # a line still being written waits
        if not complete:
            return
        self.at += len(complete) + 1
        for line in complete.decode(errors="replace").split("\n"):
            if ECHOED.match(line):
                sys.stderr.write(line + "\n")
        sys.stderr.flush()


def verdict(run_dir: str, logs: str, code: int, started: float) -> dict:
    """The metrics of the job that began at ``started`` (epoch seconds), or a
    :class:`ClusterError` naming the role that failed (Paddle's launcher's exit status alone
    does not tell)."""
    failures = []
    for name in sorted(os.listdir(logs), reverse=True) if os.path.isdir(logs) else []:
        role, _, index = name.partition("log.")  # workers first
        if role in ("worker", "server") and index.isdigit():
            message = error_line(os.path.join(logs, name))
            if message:
                line = f"{role} {index}: {message} (its log: {os.path.join(logs, name)})"
                failures.append((message, f"{role} {index}", line))
    if failures:  # the cause, rather than a role that Paddle's launcher stopped after it
        causes = [f for f in failures if not f[0].startswith("stopped by")]
        message, process, line = (causes or failures)[0]
        # only roles Paddle's launcher stopped: one of theirs died without a word (a signal)
        why = Why.ERROR if causes else Why.SIGNAL
        raise tagged(ClusterError(line), why, process, f"stopped: {message}")
    path = os.path.join(run_dir, "metrics.json")
    if not os.path.isfile(path) or os.path.getmtime(path) < started:
        raise tagged(
            ClusterError(
                f"the job ended without results (Paddle's launcher exited with "
                f"status {code}); logs in {logs}"
            ),
            Why.EXIT,
            "Paddle's launcher",
            f"exited with status {code}",
        )
    with open(path) as f:
        return json.load(f)
