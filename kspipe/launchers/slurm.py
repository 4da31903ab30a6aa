"""``cluster.launcher=slurm``: a job's processes as job steps of the Slurm allocation it runs in.

Inside an allocation (an ``sbatch`` script, ``salloc``), ``kspipe ... mode=pserver
cluster.launcher=slurm`` plans the job as kspipe's own launcher does, with the hosts of the
allocation's node list (processes spread over the nodes in turn, servers first), and
starts every process with ``srun`` as a step of one task on its node (``--exact``: steps
run side by side, each on its own CPUs).  The launcher watches the steps as it watches its
own processes (kspipe/launchers/watcher.py): their output is each role's log, one that fails
stops the rest, and the steps end with it, so nothing is left in ``squeue``.

Outside an allocation, the ``kspipe`` command submits the job with ``sbatch`` instead
(:func:`submit`): a script in the run folder that runs the same resolved config as the
launcher inside the allocation it gets, requeueable, with SIGTERM 60 s before its time
limit, and its output in the run folder.  ``cluster.slurm_args`` adds sbatch options
(``['--partition=gpu','--time=2:00:00']``).

Ports: the processes on the launcher's node take ports free there; another node's take
the same numbers (nodes of one allocation are alike; Slurm has no way to ask).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys

from kspipe import hookimpl
from kspipe.cluster.plan import Planned, launch_plan
from kspipe.errors import ConfigError
from kspipe.launchers.processes import ProcessLauncher


class SlurmLauncher(ProcessLauncher):
    """``cluster.launcher=slurm``: job steps of the allocation, or a job for sbatch."""

    name = "slurm"

    def hands_off(self, cfg) -> bool:
        return submits(cfg)

    def hand_off(self, cfg, overrides: list[str]) -> str:
        from kspipe.files import workdir

        job = submit(cfg, cfg.run_dir, workdir())
        return (
            f"submitted Slurm job {job}; follow it with squeue -j {job} and "
            f"{os.path.join(cfg.run_dir, f'slurm-{job}.out')}"
        )

    def check(self, cfg, processes: int) -> None:
        check_counts(cfg)
        if cfg.mode != "local" or os.environ.get("SLURM_JOB_ID"):  # local runs anywhere
            check_allocation(processes)

    def plan(self, kind: str, cfg, workers, servers=None, **options) -> list[Planned]:
        """Every process of the job, on the allocation's nodes."""
        check_counts(cfg)
        if kind == "local":  # one process, as a step of its own inside an allocation
            return launch_plan("local", workers)
        server_eps, worker_eps, meeting = endpoints(
            int(servers) if kind == "pserver" else 0, int(workers)
        )
        options["threads"] = options.get("threads") or threads()
        return launch_plan(
            kind, worker_eps, server_eps or None, every_host=True, meeting_port=meeting, **options
        )

    def command(self, planned: Planned, command: list[str]) -> list[str]:
        if not os.environ.get("SLURM_JOB_ID"):  # a local job outside an allocation
            return command
        node = node_of(planned.endpoint) if planned.endpoint else allocation_hosts()[0]
        return step(
            node,
            f"kspipe-{planned.role}.{planned.index}",
            command,
            int(planned.env.get("KSPIPE_THREADS") or threads()),
        )


@hookimpl
def kspipe_process_launchers():
    return [SlurmLauncher()]


def check_allocation(processes: int, env=os.environ) -> None:
    """Refuse, in one line, a launch that Slurm cannot run here: no ``srun``, outside an
    allocation, or an allocation of fewer tasks than the job's processes."""
    if shutil.which("srun") is None:
        raise ConfigError(
            "cluster.launcher=slurm: Slurm's srun is not on PATH (install "
            "Slurm's client, or use cluster.launcher=processes)"
        )
    if not env.get("SLURM_JOB_ID"):
        raise ConfigError(
            "cluster.launcher=slurm runs inside a Slurm allocation: start "
            "kspipe from an sbatch script or under salloc (docs/distributed.md)"
        )
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if tasks and int(tasks) < processes:
        raise ConfigError(
            f"the Slurm allocation (job {env['SLURM_JOB_ID']}) has {tasks} "
            f"task(s); this job needs {processes} (one per server and worker): "
            f"allocate with -n {processes} or more"
        )


def allocation_hosts(env=os.environ) -> list[str]:
    """The allocation's nodes, in order (``scontrol show hostnames``)."""
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(
            f"cannot read the Slurm allocation's nodes with scontrol: {err}"
        ) from None
    hosts = out.stdout.split()
    if out.returncode or not hosts:
        raise ConfigError(
            f"cannot read the Slurm allocation's nodes ({nodes!r}): "
            f"{out.stderr.strip() or 'scontrol printed none'}"
        )
    return hosts


def endpoints(servers: int, workers: int, env=os.environ) -> tuple[list[str], list[str], int]:
    """``host:port`` of each server and worker, spread over the allocation's nodes, and the
    port of gloo's meeting point beside the first of them.

    Every port is drawn free, the meeting point's too: the port after a drawn one is where
    Linux starts outgoing connections' ports (it draws free ports odd, theirs even), so
    "the first endpoint's port + 1" is taken now and then on a busy node.
    """
    from kspipe.cluster.endpoints import free_ports

    nodes = allocation_hosts(env)
    *ports, meeting = free_ports(servers + workers + 1)
    if len(nodes) == 1:  # one node, this one: loopback
        hosts = ["127.0.0.1"] * (servers + workers)
    else:
        addresses = node_addresses(nodes, env)
        hosts = [addresses[nodes[i % len(nodes)]] for i in range(servers + workers)]
    eps = [f"{h}:{p}" for h, p in zip(hosts, ports)]
    return eps[:servers], eps[servers:], meeting


def node_addresses(nodes: list[str], env=os.environ) -> dict:
    """``{node: address}``: where the other nodes reach each node.  Slurm's own ``NodeAddr``
    when slurm.conf gives one (the address its controller reaches the node at), else the
    node's name resolved here."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "node", ",".join(nodes)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    given = {}
    for line in out.stdout.splitlines():
        fields = dict(item.partition("=")[::2] for item in line.split() if "=" in item)
        if fields.get("NodeName") and fields.get("NodeAddr"):
            given[fields["NodeName"]] = fields["NodeAddr"]
    return {node: given[node] if given.get(node, node) != node else address(node) for node in nodes}


def address(node: str) -> str:
    """A node's address that the other nodes reach, from its name."""
    try:
        found = socket.gethostbyname(node)
    except OSError as err:
        raise ConfigError(f"the allocation's node {node} has no address here: {err}") from None
    if found.startswith("127."):
        raise ConfigError(
            f"the allocation's node {node} resolves to {found} (a loopback "
            f"address the other nodes cannot reach): fix its entry in /etc/hosts"
        )
    return found


def node_of(endpoint: str, env=os.environ) -> str:
    """The allocation's node an endpoint's process runs on."""
    nodes = allocation_hosts(env)
    host = endpoint.rpartition(":")[0]
    if len(nodes) == 1:
        return nodes[0]
    for node, found in node_addresses(nodes, env).items():
        if found == host:
            return node
    raise ConfigError(f"{endpoint} is on none of the allocation's nodes ({', '.join(nodes)})")


def step(node: str, name: str, command: list[str], cpus: int = 1) -> list[str]:
    """``command`` as a job step of one task of ``cpus`` CPUs on ``node``.  ``--exact``
    and ``--mem=0`` let the steps run side by side: without them the first step takes
    every CPU (and, where Slurm counts memory, all the memory) of the allocation, and the
    next waits for it to end."""
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={cpus}",
        "--exact",
        "--mem=0",
        f"--nodelist={node}",
        "--quiet",
        "--kill-on-bad-exit=1",
        f"--job-name={name}",
        *command,
    ]


def threads(env=os.environ) -> int:
    """A worker's math threads in an allocation: its tasks' CPUs (``--cpus-per-task``)."""
    return int(env.get("SLURM_CPUS_PER_TASK") or 1)


def check_counts(cfg) -> None:
    """Slurm places the processes: ``workers`` and ``servers`` must be counts."""
    from kspipe.cluster.endpoints import parse_endpoints

    for key in ("workers", "servers"):
        if parse_endpoints(cfg.get(key, 1), key) is not None:
            raise ConfigError(
                f"cluster.launcher=slurm places the processes itself: give {key} as a count"
            )


def submits(cfg, env=os.environ) -> bool:
    """Whether the ``kspipe`` command should submit this job rather than run it: a
    distributed mode with ``cluster.launcher=slurm``, outside an allocation."""
    from kspipe.cluster import environment

    return (
        cfg.mode in ("pserver", "collective")
        and cfg.cluster.get("launcher") == "slurm"
        and not env.get("SLURM_JOB_ID")
        and not environment.given(cfg.mode, env)
    )


def processes(cfg) -> int:
    """How many processes (tasks) the job needs."""
    from kspipe.cluster.endpoints import process_count

    check_counts(cfg)
    count = process_count(cfg.workers, "workers")
    return count + (process_count(cfg.servers, "servers") if cfg.mode == "pserver" else 0)


def submit(cfg, run_dir: str, workdir: str) -> str:
    """Submit the job with ``sbatch``; its id.  The script and the config it runs are
    written into ``run_dir``."""
    from omegaconf import OmegaConf

    if shutil.which("sbatch") is None:
        raise ConfigError(
            "cluster.launcher=slurm: Slurm's sbatch is not on PATH (install "
            "Slurm's client, or use cluster.launcher=processes)"
        )
    os.makedirs(run_dir, exist_ok=True)
    job = OmegaConf.to_container(cfg, resolve=True)
    job["run_dir"] = run_dir
    config = os.path.join(run_dir, "submitted.yaml")
    OmegaConf.save(OmegaConf.create(job), config)
    script = os.path.join(run_dir, "kspipe.sbatch")
    options = [
        "--job-name=kspipe",
        f"--ntasks={processes(cfg)}",
        "--requeue",
        "--signal=B:TERM@60",
        "--open-mode=append",
        f"--output={os.path.join(run_dir, 'slurm-%j.out')}",
        f"--chdir={workdir}",
        *[str(a) for a in cfg.cluster.get("slurm_args") or []],
    ]
    with open(script, "w") as f:
        f.write("#!/bin/bash\n")
        f.write("".join(f"#SBATCH {option}\n" for option in options))
        f.write("# the launcher of the job, in the allocation (it starts the roles with srun)\n")
        f.write(f"exec {shlex.join([sys.executable, '-m', 'kspipe.cli.worker', config])}\n")
    out = subprocess.run(
        ["sbatch", "--parsable", script], capture_output=True, text=True, timeout=120
    )
    if out.returncode:
        said = out.stderr.strip().splitlines() or [f"exit status {out.returncode}"]
        raise ConfigError(f"sbatch refused the job ({script}): {said[-1]}")
    return out.stdout.strip().split(";")[0]
