"""``cluster.launcher=slurm``: a job's processes as job steps of the Slurm allocation it runs in.

Inside an allocation (an ``sbatch`` script, ``salloc``), ``kspipe ... mode=pserver
cluster.launcher=slurm`` plans the job as kspipe's own launcher does, with the hosts of the
allocation's node list (processes spread over the nodes in turn, servers first), and
starts every process with ``srun`` as a step of one task on its node (``--exact``: steps
run side by side, each on its own CPUs).  The launcher watches the steps as it watches its
own processes (kspipe/modes/launch.py): their output is each role's log, one that fails
stops the rest, and the steps end with it, so nothing is left in ``squeue``.

Ports: the processes on the launcher's node take ports free there; another node's take
the same numbers (nodes of one allocation are alike; Slurm has no way to ask).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from kspipe.errors import ConfigError

LAUNCHERS = ("processes", "slurm")


def check_launcher(name: str, processes: int) -> None:
    """Before anything starts (no run recorded yet): refuse a launcher that cannot start
    the job's ``processes`` here, in one line."""
    if name not in LAUNCHERS:
        raise ConfigError(f"cluster.launcher={name!r} is not one of {', '.join(LAUNCHERS)}")
    if name == "slurm":
        check_allocation(processes)


def check_allocation(processes: int, env=os.environ) -> None:
    """Refuse, in one line, a launch that Slurm cannot run here: no ``srun``, outside an
    allocation, or an allocation of fewer tasks than the job's processes."""
    if shutil.which("srun") is None:
        raise ConfigError("cluster.launcher=slurm: Slurm's srun is not on PATH (install "
                          "Slurm's client, or use cluster.launcher=processes)")
    if not env.get("SLURM_JOB_ID"):
        raise ConfigError("cluster.launcher=slurm runs inside a Slurm allocation: start "
                          "kspipe from an sbatch script or under salloc (docs/distributed.md)")
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if tasks and int(tasks) < processes:
        raise ConfigError(f"the Slurm allocation (job {env['SLURM_JOB_ID']}) has {tasks} "
                          f"task(s); this job needs {processes} (one per server and worker): "
                          f"allocate with -n {processes} or more")


def allocation_hosts(env=os.environ) -> list[str]:
    """The allocation's nodes, in order (``scontrol show hostnames``)."""
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                         text=True, timeout=60)
    hosts = out.stdout.split()
    if out.returncode or not hosts:
        raise ConfigError(f"cannot read the Slurm allocation's nodes ({nodes!r}): "
                          f"{out.stderr.strip() or 'scontrol printed none'}")
    return hosts


def endpoints(servers: int, workers: int, env=os.environ) -> tuple[list[str], list[str]]:
    """``host:port`` of each server and worker, spread over the allocation's nodes."""
    from kspipe.modes.launch import free_ports

    nodes = allocation_hosts(env)
    ports = free_ports(servers + workers)
    if len(nodes) == 1:  # one node, this one: loopback
        hosts = ["127.0.0.1"] * (servers + workers)
    else:
        hosts = [socket.gethostbyname(nodes[i % len(nodes)]) for i in range(servers + workers)]
    eps = [f"{h}:{p}" for h, p in zip(hosts, ports)]
    return eps[:servers], eps[servers:]


def node_of(endpoint: str, env=os.environ) -> str:
    """The allocation's node an endpoint's process runs on."""
    nodes = allocation_hosts(env)
    host = endpoint.rpartition(":")[0]
    if len(nodes) == 1:
        return nodes[0]
    for node in nodes:
        if socket.gethostbyname(node) == host:
            return node
    raise ConfigError(f"{endpoint} is on none of the allocation's nodes ({', '.join(nodes)})")


def step(node: str, name: str, command: list[str]) -> list[str]:
    """``command`` as a job step of one task on ``node``."""
    return ["srun", "--nodes=1", "--ntasks=1", "--exact", f"--nodelist={node}", "--quiet",
            "--kill-on-bad-exit=1", f"--job-name={name}", *command]
