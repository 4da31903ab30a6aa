"""Starting and watching the processes of a cluster (or of one host's part of it).

:func:`launch_plan` is the one builder of a job's processes (used by ``mode=pserver``,
``mode=collective``, isolated local runs and ``kspipe-launch``): their roles, endpoints
and environment, with this host's ports checked.  :class:`Cluster` starts and watches them.

kspipe starts every role itself with Paddle's environment contract (``TRAINING_ROLE``,
``PADDLE_TRAINER_ID``, ``PADDLE_PSERVERS_IP_PORT_LIST``, ...), so a scheduler that sets
those variables can start the same roles without kspipe's launcher.  Each role writes
``<run_dir>/logs/<role>.<index>.log``.  Paddle's own launcher exits 0 even when workers
crash; this one watches every process and, as soon as one fails, stops the rest and
names the failed role and its log.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from kspipe.endpoints import check_port_free, endpoints, free_ports, parse_endpoints, this_host
from kspipe.errors import ClusterError, ConfigError
from kspipe.files import WORKDIR_ENV, workdir

JOB_FILE = "job.yaml"
LOCAL_HOSTS = ("127.0.0.1", "localhost")
STOP_GRACE_S = 5.0
CAUSE_GRACE_S = 2.0  # how long a failure's peers may take to exit by themselves


class Launcher:
    """What the role stage returns when this command starts the job's processes instead of
    playing a part in them (:class:`kspipe.contracts.Launcher`).  It is no role: it trains
    nothing, so it has no optimiser, table or server loop to offer; the pipeline calls
    :meth:`launch` and records what it returns."""

    is_launcher = True
    mode = "local"

    def __init__(self, cfg, hosts=None, launcher=None):
        #: ``hosts``: the job's hosts when it spans several (kspipe's own control link);
        #: ``launcher``: the process launcher (:mod:`kspipe.modes.launchers`) that starts
        #: the planned processes (None: as they are, on this host)
        self.cfg, self.hosts, self.launcher = cfg, hosts, launcher

    def is_first_worker(self) -> bool:
        """Whether worker 0 runs on this host (its launcher records the run)."""
        return self.hosts is None or self.hosts.is_first

    def refuses(self, needs, cfg) -> str | None:
        """Why the job's roles cannot run a workload that ``needs`` these (their mode's
        answer, given before any process starts); None if they can."""
        return None

    def launch(self, reporter) -> dict:
        """Start the job's processes on this host, watch them, return the job's metrics."""
        raise NotImplementedError


def worker_command(run_dir: str) -> list[str]:
    """What a launched process runs: the job's stages from ``<run_dir>/job.yaml``."""
    return [sys.executable, "-u", "-m", "kspipe.worker", os.path.join(run_dir, JOB_FILE)]


@dataclass
class Process:
    role: str  # "server" or "worker"
    index: int
    popen: subprocess.Popen
    log: str
    threads: list = field(default_factory=list)

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

    def start(self, role: str, index: int, env: dict, command: list[str] | None = None,
              cwd: str | None = None) -> Process:
        """Start one role: ``command`` (default: the job's stages, :func:`worker_command`),
        in ``cwd`` (default: the run folder, so nothing a process writes lands elsewhere)."""
        os.makedirs(self.log_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, f"{role}.{index}.log")
        log = open(log_path, "w", buffering=1)
        cmd = command or worker_command(self.run_dir)
        popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                                 cwd=cwd or self.run_dir, preexec_fn=_die_with_parent)
        process = Process(role, index, popen, log_path)
        echo = self.echo_first_worker if (role == "worker" and index == 0) else False
        thread = threading.Thread(target=_copy_output, args=(popen.stdout, log, echo), daemon=True)
        thread.start()
        process.threads.append(thread)
        self.processes.append(process)
        return process

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.2, check=None) -> None:
        """Return when every worker exited 0 (servers are then stopped); raise on a failure,
        or when ``check()`` names one elsewhere (another host's)."""
        started = time.monotonic()
        while True:
            failure = check() if check is not None else None
            if failure:
                self.stop()
                raise ClusterError(f"{failure}; this host's processes were stopped")
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
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                self.stop()
                raise ClusterError(f"the cluster did not finish within cluster.timeout_s="
                                   f"{timeout_s:g} s; logs in {self.log_dir}")
            time.sleep(poll_s)

    def _failure(self, failed: "Process", code: int) -> ClusterError:
        """Stop the job; the error that names why it failed.

        A process that stops on a one-line error of its own (bad config or data: its log's
        ``kspipe: error:`` line) takes its peers down with it, and one of them may exit
        first (its connection to it broke).  So the others get a moment to exit by
        themselves, and a process that did with such a line is the one named.
        """
        deadline = time.monotonic() + CAUSE_GRACE_S
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in self.processes):
            time.sleep(0.05)
        exited = [p for p in self.processes if p.popen.poll() not in (None, 0)]
        self.stop()
        for p in exited:
            message = error_line(p.log)
            if message:
                return ClusterError(f"{p.name}: {message} (its log: {p.log})")
        return ClusterError(f"{failed.name} {_describe_exit(code)}; its log: {failed.log}"
                            f"{_last_line(failed.log)}")

    def _finish_servers(self, grace_s: float = 30.0) -> None:
        """Servers stop when the first worker asks them to; wait, then make sure."""
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            if p.role == "server":
                while p.popen.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
        self.stop()

    def stop(self) -> None:
        """Terminate every process still running (and its children); kill after a grace."""
        for p in self.processes:
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
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


def _die_with_parent() -> None:
    """In a started process: be killed when the launcher dies, even by SIGKILL (Linux)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own stop() remains
        pass


PR_SET_PDEATHSIG = 1


def _signal_group(popen, sig) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# What of the first worker's output the console shows: kspipe's own lines, not Paddle's.
#: What the first worker's output shows on the launcher's terminal: its messages and
#: progress lines, but not its error line, which the launcher's own error repeats.
_ECHOED = re.compile(r"^(kspipe: (?!error:)|[\w ()-]+ \d+/\d+ \| )")


def _copy_output(stream, log, echo: bool) -> None:
    with log:
        for line in stream:
            log.write(line)
            if echo is True and _ECHOED.match(line) or echo == "all":
                sys.stderr.write(line)
                sys.stderr.flush()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _last_line(path: str) -> str:
    """The log's last error line, to show beside the failure."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("kspipe: error:") or "Error" in line:
            return f" ({line[:300]})"
    return ""


def error_line(path: str) -> str | None:
    """The message of the last ``kspipe: error:`` line of a role's log, if any."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.startswith("kspipe: error:")]
    except OSError:
        return None
    return lines[-1][len("kspipe: error:"):].strip() if lines else None


def run_cluster(cfg, reporter, plan: list["Planned"], description: str, hosts=None,
                launcher=None) -> dict:
    """Start the processes of ``plan``, wait, return the job's metrics.

    The processes run the stages from ``<run_dir>/job.yaml``, each started as
    ``launcher`` (a :class:`kspipe.modes.launchers.ProcessLauncher`) says; the first
    worker writes ``metrics.json``.  The roles' logs become the run's ``logs`` artifacts,
    also when the job fails.  ``hosts`` (:class:`kspipe.modes.hosts.JobHosts`): the job
    spans several hosts, whose launchers watch each other; on a host without worker 0 the
    result is ``{}`` (worker 0's host records the run).
    """
    from kspipe.modes.hosts import HostLink

    run_dir = reporter.run_dir
    write_job(cfg, run_dir)
    cluster = Cluster(run_dir)
    link = HostLink(hosts, cfg.cluster.hosts_timeout_s) if hosts else None
    try:
        if link:
            link.open(reporter.say)
        reporter.say(f"starting {description}; logs in {cluster.log_dir}")
        for p in plan:
            command = worker_command(run_dir)
            cluster.start(p.role, p.index, p.env,
                          launcher.command(p, command) if launcher else command)
        cluster.wait(cfg.cluster.timeout_s, check=link.failure if link else None)
    except BaseException as err:
        if link:
            link.close(failure=why_stopped(err))
        raise
    finally:
        cluster.stop()
        reporter.artifact(cluster.log_dir, "logs")
    if link:
        link.close()
        if not hosts.is_first:
            reporter.say(f"this host's part of the job finished; {hosts.first} (worker 0's "
                         f"host) records the run")
            return {}
    path = os.path.join(run_dir, "metrics.json")
    if not os.path.isfile(path):
        raise ClusterError(f"the job ended without results; logs in {cluster.log_dir}")
    with open(path) as f:
        return json.load(f)


def why_stopped(err: BaseException) -> str:
    """A launcher's failure, for the other hosts."""
    from kspipe.stopping import Preempted

    if isinstance(err, Preempted):
        return f"its launcher was stopped by {err.name}"
    return str(err) or f"its launcher was stopped ({type(err).__name__})"


# --- the launch plan ---------------------------------------------------------------


@dataclass
class Planned:
    """One process of a job: its role, index, endpoint and environment."""

    role: str  # "server" or "worker"
    index: int
    endpoint: str
    env: dict


def launch_plan(kind: str, workers, servers=None, host: str | None = None,
                meeting_dir: str | None = None, threads: int | None = None,
                devices: list[int] | None = None, log_dir: str | None = None,
                every_host: bool = False) -> list[Planned]:
    """The processes this host starts for a ``kind`` ("pserver", "collective" or "local":
    one process of its own) job.

    ``workers`` and ``servers`` are counts (free ports on 127.0.0.1 are taken) or
    ``host:port`` lists (a job across hosts; ``host`` names this one when they name
    several).  Each process gets Paddle's environment contract (``TRAINING_ROLE``,
    ``PADDLE_TRAINER_ID``, ``PADDLE_TRAINER_ENDPOINTS`` ...), so a scheduler that sets the
    same variables can start the roles without kspipe, and ``OMP_NUM_THREADS`` so this
    host's workers share its cores (``threads`` each, default cores / local workers).
    The ports of this host's processes are checked free.  With ``every_host``, the plan
    holds every host's processes (a scheduler starts each on its host).
    """
    if kind == "local":
        return [Planned("worker", 0, "", dict(os.environ, **{WORKDIR_ENV: workdir()}))]
    worker_eps = endpoints(workers, "workers")
    server_eps = endpoints(servers, "servers") if kind == "pserver" else []
    everyone = server_eps + worker_eps
    here = this_host(host, everyone) if not every_host else None
    local = [(role, i, e) for role, eps in (("server", server_eps), ("worker", worker_eps))
             for i, e in enumerate(eps) if every_host or e.rpartition(":")[0] == here]
    if not local:
        raise ConfigError(f"no server or worker endpoint is on cluster.host={here}")
    for _, _, endpoint in local:
        address, _, port = endpoint.rpartition(":")
        if address in LOCAL_HOSTS or not every_host:
            check_port_free(address, int(port))
    local_workers = sum(1 for role, _, _ in local if role == "worker")
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, local_workers))
    base = dict(os.environ, GLOG_minloglevel="2", **{WORKDIR_ENV: workdir()},
                PADDLE_TRAINER_ENDPOINTS=",".join(worker_eps),
                PADDLE_TRAINERS_NUM=str(len(worker_eps)))
    if kind == "pserver":
        base.update(PADDLE_PSERVERS_IP_PORT_LIST=",".join(server_eps),
                    PADDLE_PSERVER_NUMS=str(len(server_eps)),
                    **fleet_gloo_env(meeting_dir, everyone))
    else:
        base[GLOO_ENDPOINT_ENV] = gloo_endpoint(workers, worker_eps)
    if log_dir:
        base[LOG_DIR_ENV] = log_dir
    plan = []
    for role, index, endpoint in local:
        env = dict(base, PADDLE_PORT=endpoint.rpartition(":")[2],
                   OMP_NUM_THREADS=str(1 if role == "server" else threads),
                   KSPIPE_THREADS=str(1 if role == "server" else threads))
        if kind == "pserver":
            env.update(TRAINING_ROLE="PSERVER" if role == "server" else "TRAINER",
                       PADDLE_TRAINER_ID=str(index if role == "worker" else 0),
                       POD_IP=endpoint.rpartition(":")[0])
        else:
            env.update(PADDLE_TRAINER_ID=str(index), PADDLE_CURRENT_ENDPOINT=endpoint)
            if devices:
                env["FLAGS_selected_gpus"] = str(devices[index % len(devices)])
        plan.append(Planned(role, index, endpoint, env))
    return plan


#: Where a collective job's workers meet to set up gloo (worker 0 serves it).
GLOO_ENDPOINT_ENV = "KSPIPE_GLOO_ENDPOINT"
#: The job's log folder, where a process puts the files Paddle would leave elsewhere.
LOG_DIR_ENV = "KSPIPE_LOG_DIR"


def gloo_endpoint(workers, worker_eps: list[str]) -> str:
    """A free port beside worker 0 on one host; across hosts, worker 0's port + 1."""
    host, _, port = worker_eps[0].rpartition(":")
    if parse_endpoints(workers, "workers") is None:
        return f"{host}:{free_ports(1, host)[0]}"
    return f"{host}:{int(port) + 1}"


def fleet_gloo_env(meeting_dir: str | None, endpoints: list[str]) -> dict:
    """Where a parameter-server job's processes meet for fleet's gloo: a fresh folder on
    one host, else HTTP beside the first endpoint (its port + 1)."""
    if meeting_dir and all(e.rpartition(":")[0] in LOCAL_HOSTS for e in endpoints):
        shutil.rmtree(meeting_dir, ignore_errors=True)  # an earlier job's addresses are stale
        return {"PADDLE_WITH_GLOO": "1", "PADDLE_GLOO_RENDEZVOUS": "2",
                "PADDLE_GLOO_FS_PATH": meeting_dir}
    host, _, port = endpoints[0].rpartition(":")
    return {"PADDLE_WITH_GLOO": "1", "PADDLE_GLOO_RENDEZVOUS": "3",
            "PADDLE_GLOO_HTTP_ENDPOINT": f"{host}:{int(port) + 1}"}


def write_job(cfg, run_dir: str) -> str:
    """Write the resolved config every role of the job runs."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, JOB_FILE)
    job = OmegaConf.to_container(cfg, resolve=True)
    job["run_dir"] = run_dir
    OmegaConf.save(OmegaConf.create(job), path)
    return path
