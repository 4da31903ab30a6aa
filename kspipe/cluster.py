"""Starting and watching the processes of a local (or one host's part of a) cluster.

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
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from kspipe.errors import ClusterError, ConfigError

JOB_FILE = "job.yaml"
LOCAL_HOSTS = ("127.0.0.1", "localhost")
STOP_GRACE_S = 5.0


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def check_port_free(host: str, port: int) -> None:
    s = socket.socket()
    try:
        s.bind((host, port))
    except OSError as err:
        raise ConfigError(f"port {host}:{port} is not free: {err.strerror}") from err
    finally:
        s.close()


def parse_endpoints(value, key: str) -> list[str] | None:
    """An endpoint list ``host:port,...`` from the config, or None for a count."""
    if isinstance(value, int):
        return None
    endpoints = [e.strip() for e in str(value).split(",") if e.strip()]
    if not endpoints:
        raise ConfigError(f"{key}={value!r} is neither a count nor a host:port list")
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{key}: {endpoint!r} is not host:port")
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"{key}: an endpoint appears twice in {value}")
    return endpoints


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

    def start(self, role: str, index: int, env: dict, command: list[str] | None = None) -> Process:
        """Start one role: ``command`` (default: the job's stages, ``kspipe.worker``)."""
        os.makedirs(self.log_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, f"{role}.{index}.log")
        log = open(log_path, "w", buffering=1)
        cmd = command or [sys.executable, "-u", "-m", "kspipe.worker",
                          os.path.join(self.run_dir, JOB_FILE)]
        popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, text=True)
        process = Process(role, index, popen, log_path)
        echo = self.echo_first_worker if (role == "worker" and index == 0) else False
        thread = threading.Thread(target=_copy_output, args=(popen.stdout, log, echo), daemon=True)
        thread.start()
        process.threads.append(thread)
        self.processes.append(process)
        return process

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.2) -> None:
        """Return when every worker exited 0 (servers are then stopped); raise on a failure."""
        started = time.monotonic()
        while True:
            for p in self.processes:
                code = p.popen.poll()
                if code not in (None, 0):
                    self.stop()
                    raise ClusterError(f"{p.name} {_describe_exit(code)}; its log: {p.log}"
                                       f"{_last_line(p.log)}")
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


def run_cluster(cfg, reporter, plan: list[tuple[str, int, dict]], description: str) -> dict:
    """Start the ``(role, index, env)`` processes of ``plan``, wait, return the job's metrics.

    The processes run the stages from ``<run_dir>/job.yaml``; the first worker writes
    ``metrics.json``.  The roles' logs become the run's ``logs`` artifacts, also when the
    job fails.
    """
    run_dir = reporter.run_dir
    write_job(cfg, run_dir)
    cluster = Cluster(run_dir)
    reporter.say(f"starting {description}; logs in {cluster.log_dir}")
    try:
        for role, index, env in plan:
            cluster.start(role, index, env)
        cluster.wait(cfg.cluster.timeout_s)
    finally:
        cluster.stop()
        reporter.artifact(cluster.log_dir, "logs")
    path = os.path.join(run_dir, "metrics.json")
    if not os.path.isfile(path):
        raise ClusterError(f"the job ended without results; logs in {cluster.log_dir}")
    with open(path) as f:
        return json.load(f)


def threads_per_worker(cfg, local_workers: int) -> int:
    """Math threads for each worker so this host's workers do not fight over its cores."""
    return cfg.cluster.threads or max(1, (os.cpu_count() or 1) // max(1, local_workers))


def gloo_env(run_dir: str, endpoints: list[str], http_endpoint: str) -> dict:
    """Where the job's processes meet for gloo: a folder on one host, else HTTP."""
    if all(e.rpartition(":")[0] in LOCAL_HOSTS for e in endpoints):
        meeting = os.path.join(run_dir, "gloo")
        shutil.rmtree(meeting, ignore_errors=True)  # an earlier job's addresses are stale
        return {"PADDLE_WITH_GLOO": "1", "PADDLE_GLOO_RENDEZVOUS": "2",
                "PADDLE_GLOO_FS_PATH": meeting}
    return {"PADDLE_WITH_GLOO": "1", "PADDLE_GLOO_RENDEZVOUS": "3",
            "PADDLE_GLOO_HTTP_ENDPOINT": http_endpoint}


def local_endpoints(value, key: str) -> list[str]:
    """The endpoints ``value`` lists, or that many free ports on 127.0.0.1."""
    listed = parse_endpoints(value, key)
    if listed is not None:
        return listed
    return [f"127.0.0.1:{port}" for port in free_ports(int(value))]


def this_host(cfg, endpoints: list[str]) -> str:
    """The host whose roles this command starts."""
    hosts = {e.rpartition(":")[0] for e in endpoints}
    host = cfg.cluster.host or (hosts.pop() if len(hosts) == 1 else None)
    if host is None:
        raise ConfigError("the endpoints name several hosts: set cluster.host to this "
                          "host's address, and run the same command on each host")
    return host


def write_job(cfg, run_dir: str) -> str:
    """Write the resolved config every role of the job runs."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, JOB_FILE)
    job = OmegaConf.to_container(cfg, resolve=True)
    job["run_dir"] = run_dir
    OmegaConf.save(OmegaConf.create(job), path)
    return path
