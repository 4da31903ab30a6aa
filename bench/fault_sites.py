"""Where the fault campaign's jobs run (bench/faults.py ``--launcher``): kspipe's own
launcher on this host (:class:`Processes`), job steps of a local Slurm's allocation
(:class:`Slurm`), or emulated hosts (bench/fault_hosts.py); the job each trial starts, and
the processes a fault may hit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))

from kspipe.testing import tiny_overrides  # noqa: E402
from tests import kit  # noqa: E402

ITERATIONS, EVERY, KEEP, STALL_S = 24, 4, 2, 20
KINDS = {
    "sync": ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=sync"],
    "sync-3": ["mode=pserver", "workers=3", "servers=1", "cluster.strategy=sync"],
    "async": ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=async"],
    "geo": ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=geo", "cluster.k_steps=2"],
    "collective": ["mode=collective", "workers=2"],
}
FAULTS = ["SIGKILL", "SIGSTOP", "checkpoint removed"]


def overrides(kind: str, folder: Path, data: Path, restarts: int) -> list[str]:
    return [
        "+experiment=omniglot_5way",
        *tiny_overrides(folder, data),
        *KINDS[kind],
        f"train.meta_iters={ITERATIONS}",
        f"train.checkpoint_every={EVERY}",
        f"train.keep_checkpoints={KEEP}",
        "eval.interval=0",
        "eval.baseline=false",
        f"cluster.max_restarts={restarts}",
        f"cluster.stall_seconds={STALL_S}",
    ]


def counts(kind: str) -> dict:
    """A kind's ``workers`` and ``servers`` (0 where it has none)."""
    given = dict(o.split("=") for o in KINDS[kind] if o.startswith(("workers", "servers")))
    return {"workers": int(given["workers"]), "servers": int(given.get("servers", 0))}


class Processes:
    """Jobs started by kspipe's own launcher on this host."""

    faults = FAULTS

    def roles(self, kind: str) -> list[tuple]:
        """The processes a fault may hit: (role, index)."""
        chosen = [("worker", 0), ("worker", 1)]
        return chosen + ([("server", 0)] if counts(kind)["servers"] else [])

    def loses_host(self, plan: dict) -> str | None:
        """The host a fault takes from the job for good (None: a process, which restarts)."""
        return None

    def extra_s(self, plan: dict) -> float:
        """How much longer than 30 s the job may take to fail after ``plan``'s fault."""
        return 0.0

    def command(self, kind: str, folder: Path, data: Path, restarts: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            *overrides(kind, folder, data, restarts),
        ]

    def start(self, kind: str, folder: Path, data: Path, restarts: int):
        folder.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            self.command(kind, folder, data, restarts),
            env=self.env(),
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def env(self) -> dict:
        return dict(os.environ)

    def inject(self, fault: str, role: str, index: int, run_dir: Path) -> str | None:
        pid = role_pid(run_dir, role, index)
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL if fault == "SIGKILL" else signal.SIGSTOP)
        return f"{role} {index}"


class Slurm(Processes):
    """Jobs run as job steps of a ``salloc`` allocation of the local Slurm (``env``)."""

    def __init__(self, env: dict):
        self.slurm_env = env

    def command(self, kind, folder, data, restarts) -> list[str]:
        tasks = sum(counts(kind).values())
        own = super().command(kind, folder, data, restarts)
        return ["salloc", "-n", str(tasks), "--quiet", *own, "cluster.launcher=slurm"]

    def env(self) -> dict:
        return dict(os.environ, **self.slurm_env)


def role_pid(run_dir: Path, role: str, index: int) -> int | None:
    """The pid of the job's ``role`` ``index`` (a worker, the server, the server's shard
    summer), if it runs (the role itself, not the ``srun`` that started it)."""
    if role != "summer":
        return kit.role_pid(run_dir, role, index, step=True)
    server = kit.role_pid(run_dir, "server", 0, step=True)
    out = subprocess.run(
        ["pgrep", "-P", str(server or 0), "-f", "kspipe.modes.ps.summer"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return int(out[0]) if out else None


@contextlib.contextmanager
def launched(launcher: str, tmp: Path):
    """Where the jobs run: :class:`Processes`, :class:`Slurm` (a local Slurm of its own) or
    :class:`fault_hosts.Hosts` (emulated hosts of their own)."""
    if launcher == "processes":
        yield Processes()
    elif launcher == "slurm":
        from tests.kit.slurm import local_slurm, slurm_missing

        if slurm_missing():
            raise SystemExit(f"--launcher slurm: {slurm_missing()}")
        with local_slurm(tmp / "slurm") as env:
            yield Slurm(env)
    else:
        from fault_hosts import hosts

        with hosts(Processes) as site:
            yield site
