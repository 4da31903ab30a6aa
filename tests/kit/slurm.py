"""A Slurm cluster on loopback for a test: its daemons started with a configuration of
their own (nothing in /etc), stopped at the end."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

SLURM_CONF = """ClusterName=kspipe
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
#: One node: this host, 8 CPUs.  Several: nodes ``node1``, ``node2`` ... of 4 CPUs each, all
#: this host, each its own slurmd at a loopback address of its own (127.0.0.<i>).
ONE_NODE = "NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN"
NODE = "NodeName={name} NodeHostname={host} NodeAddr={address} Port={port} CPUs=4 State=UNKNOWN"
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sinfo", "scontrol")


def slurm_missing() -> str | None:
    """Why a one-node Slurm cannot be started here, or None."""
    import shutil

    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; README: Slurm)"
    if os.geteuid() != 0:
        return "a one-node Slurm runs its daemons as root"
    return None


@contextlib.contextmanager
def local_slurm(folder: Path, nodes: int = 1, network=None):
    """A Slurm cluster on loopback, configured under ``folder`` (nothing in /etc); yields
    the environment its commands need (``SLURM_CONF``).  Its daemons are stopped at the end.

    One node is this host with 8 CPUs, so that small jobs' steps run side by side.  With
    ``nodes`` > 1, each node (``node1``, ``node2`` ...) is a slurmd of its own on this host,
    at an address of its own (127.0.0.1, 127.0.0.2 ...), as a cluster of several machines
    looks to a job: its node list, each node's ``NodeAddr``, steps placed on a node.

    ``network`` (a :class:`tests.kit.network.Network` of at least ``nodes`` hosts): node
    ``i``'s slurmd runs in host ``i`` of it, at that host's address, and the controller in
    the first host, so a job's steps run on the emulated hosts and talk over its links;
    Slurm's commands must then run in a host of it (``network.hosts[0].run``)."""
    import socket
    import subprocess
    import time

    from kspipe.cluster.endpoints import free_ports

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state").mkdir(exist_ok=True)
    host = socket.gethostname()
    ctld_port, slurmd_port, *ports = free_ports(2 + nodes)
    names = [host] if nodes == 1 and network is None else [f"node{i + 1}" for i in range(nodes)]
    if network is not None:
        places = [(h.address, _with_cgroups(h.command)) for h in network.hosts[:nodes]]
        controller = f"{host}({network.hosts[0].address})"
    else:
        places = [(f"127.0.0.{i + 1}", lambda args: args) for i in range(nodes)]
        controller = host
    lines = (
        [ONE_NODE.format(host=host)]
        if len(names) == 1 and network is None
        else [
            NODE.format(name=name, host=host, address=address, port=port)
            for name, (address, _), port in zip(names, places, ports)
        ]
    )
    in_first = places[0][1]  # Slurm's commands, where the controller is reachable
    conf = folder / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=controller,
            folder=folder,
            ctld_port=ctld_port,
            slurmd_port=slurmd_port,
            nodes="\n".join(lines),
            names=",".join(names),
        )
    )
    env = {"SLURM_CONF": str(conf)}
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    munge_pid = folder / "munged.pid"
    try:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
            subprocess.run(
                ["munged", "--force", f"--pid-file={munge_pid}"], check=True, capture_output=True
            )
        subprocess.run(in_first(["slurmctld", "-f", str(conf)]), check=True, capture_output=True)
        for name, (_, place) in zip(names, places):
            subprocess.run(
                place(["slurmd", "-f", str(conf), "-N", name]), check=True, capture_output=True
            )
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(
                in_first(["sinfo", "-h", "-o", "%t"]),
                env=dict(os.environ, **env),
                capture_output=True,
                text=True,
            ).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the local Slurm did not come up (sinfo: {state!r}); logs in {folder}"
                )
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(
            in_first(["scancel", "--full", "--user=root"]),
            env=dict(os.environ, **env),
            capture_output=True,
        )
        for pid_file in [
            *(folder / f"slurmd-{name}.pid" for name in names),
            folder / "slurmctld.pid",
            munge_pid,
        ]:
            stop_daemon(pid_file)


def _with_cgroups(command):
    """``command`` (a host's ``ip netns exec``), for a slurmd: ``ip netns exec`` mounts a
    /sys of the host's network, without the machine's cgroup file systems, which slurmd
    will not start without; they are mounted again there, as the machine has them (in the
    command's own mount namespace: the machine's are untouched)."""
    mounts = []
    with open("/proc/self/mounts") as f:
        for line in f:
            source, point, kind, options = line.split()[:4]
            if point.startswith("/sys/fs/cgroup") and kind in ("tmpfs", "cgroup", "cgroup2"):
                mounts.append(f"mkdir -p {point} && mount -t {kind} -o {options} {source} {point}")
    script = " && ".join([*mounts, 'exec "$@"'])
    return lambda args: command(["sh", "-c", script, "sh", *args])


def stop_daemon(pid_file: Path, grace_s: float = 10.0) -> None:
    """SIGTERM to the daemon ``pid_file`` names, if any; SIGKILL if it is still there after
    ``grace_s``."""
    import time

    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        if "\nState:\tZ" in status:  # exited; its parent has yet to reap it
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def slurm_command(env: dict, *command, timeout=600, place=None, cwd=None):
    """A Slurm command run with the cluster's ``env`` (``place``: in a host of an emulated
    network, :meth:`tests.kit.network.Host.command`); its ``subprocess.CompletedProcess``."""
    import subprocess

    command = list(command) if place is None else place(list(command))
    return subprocess.run(
        command,
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def nothing_queued(env: dict, within_s: float = 30) -> bool:
    """Whether Slurm's queue empties within ``within_s`` (a job that ended may still be
    completing for a moment)."""
    import time

    deadline = time.monotonic() + within_s
    while slurm_command(env, "squeue", "-h").stdout.strip():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def salloc_command(tmp: Path, tiny_data, run: Path, *salloc, overrides=()) -> list:
    """``salloc <salloc> kspipe ...``: the tiny job, with ``overrides`` added, through
    ``cluster.launcher=slurm``, its run folder ``run``."""
    import sys

    from tests.kit.jobs import scheduled_overrides

    return [
        "salloc",
        *salloc,
        "--quiet",
        sys.executable,
        "-m",
        "kspipe.cli.command",
        *scheduled_overrides(tmp, tiny_data),
        *overrides,
        "cluster.launcher=slurm",
        f"run_dir={run}",
    ]


def allocated_job(
    tmp: Path, tiny_data, slurm: dict, expected: dict, *salloc, place=None, overrides=()
) -> Path:
    """The tiny job, with ``overrides`` added, run by ``salloc <salloc> kspipe ...
    cluster.launcher=slurm`` (``place``: in a host of an emulated network): it succeeds,
    reaches the ``expected`` weights bit for bit and records one FINISHED run; its run
    folder."""
    import numpy as np

    from kspipe.testing import run_statuses
    from tests.kit.jobs import latest_weights

    run = tmp / "run"
    command = salloc_command(tmp, tiny_data, run, *salloc, overrides=overrides)
    result = slurm_command(slurm, *command, place=place, cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    got = latest_weights(run)
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp / "mlflow.db") == ["FINISHED"]
    return run
