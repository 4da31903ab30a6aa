"""``bench/faults.py --launcher hosts``: the campaign's jobs across emulated hosts
(tests/kit/network.py), one ``kspipe`` launcher a host, every host writing into one run
folder (as on a shared volume) and worker 0's host recording the run.

Worker ``i`` runs on host ``h<i+1>``, the server (and its shard summer) beside worker 0 on
``h1``, the first host.  Beside the processes' faults, a trial may kill the launcher of
worker 1's host (``launcher 1``) or pull that host's cable (``link cut``: no FIN, no RST;
whichever process the trial drew: the first host's loss ends the job on the others, a
case of its own, tests/modes/test_host_failures.py).
Either takes the host from the job for good (nothing starts its launcher again), so the job
must fail in one line naming the host: within ``cluster.peer_timeout`` (a cut), then
``cluster.hosts_timeout_s`` for the restart that waits for it, and 30 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.kit.network import Network

PEER_TIMEOUT_S, HOSTS_TIMEOUT_S = 8, 12  # the hosts found missing before the stall watch (20 s)
SERVER_PORT, WORKER_PORT = 6000, 6100


class HostsJob:
    """The launchers of one job, seen as one process: running while any runs; its
    standard error and exit status are the first host's."""

    def __init__(self, launchers: list[subprocess.Popen]):
        self.launchers = launchers
        self.returncode = None

    def poll(self):
        if any(p.poll() is None for p in self.launchers):
            return None
        self.returncode = self.launchers[0].returncode
        return self.returncode

    def kill(self) -> None:
        for launcher in self.launchers:
            if launcher.poll() is None:
                launcher.kill()

    def communicate(self):
        errs = [launcher.communicate()[1] for launcher in self.launchers]
        self.poll()
        return None, errs[0]


def hosts(processes_class):
    """The emulated network's site, made a class of the campaign's :class:`Processes`
    (imported here, not there: bench/faults.py runs as a script)."""

    class Hosts(processes_class):
        faults = [*processes_class.faults, "link cut"]

        def __init__(self, network: Network):
            self.network = network

        def roles(self, kind: str) -> list[tuple]:
            # shard summers sum a sync job's rounds from 3 workers on, where the job meets
            # at kspipe's address book: across hosts (on one host it meets in a folder)
            summer = [("summer", 0)] if kind == "sync-3" else []
            return [*super().roles(kind), *summer, ("launcher", 1)]

        def loses_host(self, plan: dict) -> str | None:
            launcher = plan["role"] == "launcher" and plan["fault"] == "SIGKILL"
            if plan["fault"] == "link cut" or launcher:
                return self.network.hosts[1].address  # worker 1's
            return None

        def extra_s(self, plan: dict) -> float:
            return PEER_TIMEOUT_S + HOSTS_TIMEOUT_S if self.loses_host(plan) else 0.0

        def host_of(self, role: str, index: int):
            return self.network.hosts[index if role in ("worker", "launcher") else 0]

        def endpoints(self, kind: str) -> list[str]:
            from fault_sites import counts

            count = counts(kind)
            workers = [f"{h.address}:{WORKER_PORT}" for h in self.network.hosts[: count["workers"]]]
            servers = [f"{self.network.hosts[0].address}:{SERVER_PORT}"] * bool(count["servers"])
            listed = [f"workers=[{','.join(workers)}]"]
            return listed + ([f"servers=[{','.join(servers)}]"] if servers else [])

        def start(self, kind, folder, data, restarts):
            from fault_sites import counts

            folder.mkdir(parents=True, exist_ok=True)
            own = self.command(kind, folder, data, restarts)
            command = [a for a in own if not a.startswith(("workers=", "servers="))]
            launchers = []
            for host in self.network.hosts[: counts(kind)["workers"]]:
                launchers.append(
                    host.popen(
                        [
                            *command,
                            *self.endpoints(kind),
                            f"cluster.host={host.address}",
                            f"cluster.peer_timeout={PEER_TIMEOUT_S}",
                            f"cluster.hosts_timeout_s={HOSTS_TIMEOUT_S}",
                        ],
                        env=dict(self.env(), KSPIPE_JOB_SECRET="6b" * 32),
                        cwd=folder,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
                time.sleep(0.2)  # the first host listens first
            return HostsJob(launchers)

        def inject(self, fault, role, index, run_dir: Path):
            host = self.host_of(role, index)
            if fault == "link cut":  # worker 1's host: the first host's loss is another story
                self.network.cut(self.network.hosts[1])
                return "the host of worker 1"
            if role == "launcher":
                pid = launcher_pid(run_dir, host.address)
                if pid is None:
                    return None
                os.kill(pid, signal.SIGKILL)
                return f"{role} {index}"
            return super().inject(fault, role, index, run_dir)

    return _site(Hosts)


@contextlib.contextmanager
def _site(hosts_class):
    """A network of 3 hosts for each trial would cost seconds; one for the campaign, its
    cut links put back after each trial."""
    with Network(hosts=3, mbit=1000, names=False) as network:
        site = hosts_class(network)
        original = site.start

        def start(*args, **kwargs):
            for host in network.hosts:  # a link an earlier trial cut, back up
                subprocess.run(["ip", "-n", network.bridge, "link", "set", host.name, "up"])
            return original(*args, **kwargs)

        site.start = start
        yield site


def launcher_pid(run_dir: Path, address: str) -> int | None:
    """The pid of the ``kspipe`` launcher of ``run_dir`` on the host at ``address``."""
    out = subprocess.run(
        ["pgrep", "-f", f"kspipe.cli.command .*run_dir={run_dir}"], capture_output=True, text=True
    ).stdout.split()
    for pid in out:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"cluster.host={address}".encode() in cmdline:
            return int(pid)
    return None
