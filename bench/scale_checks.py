"""What must hold at every size, checked on the emulated network (root only):

    python bench/scale_checks.py --workers 8 --servers 4

* sync repeats bit for bit: the same sync job twice across hosts, and once on one host over
  loopback, end with the same parameters (their digests);
* a process killed ends the job: a sync job's last worker is killed (SIGKILL) mid-training;
  printed: the seconds from the kill to the last launcher's end, the launchers' exit codes,
  the processes left in the hosts (none), and the job's MLflow runs (one, FAILED).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_jobs import (  # noqa: E402
    job_overrides,
    plugin_environment,
    start_launchers,
    whole_job,
)
from kspipe.testing import begun_store  # noqa: E402
from kspipe.testing.commands import run_statuses  # noqa: E402
from tests.kit.network import Network, processes_in  # noqa: E402


def loopback_digest(workers: int, servers: int, weights: int, steps: int, env: dict) -> str:
    """The final parameters' digest of the same sync job on this one host."""
    folder = Path(tempfile.mkdtemp(prefix="kspipe-scale-loop-"))
    try:
        result = subprocess.run(
            [
                str(Path(sys.executable).with_name("kspipe")),
                "+experiment=scale",
                "mode=pserver",
                "cluster.strategy=sync",
                f"workers={workers}",
                f"servers={servers}",
                "tracking.enabled=false",
                f"scale.weights={weights}",
                f"scale.steps={steps}",
                f"run_dir={folder / 'run'}",
            ],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if result.returncode:
            raise SystemExit(f"the loopback job failed:\n{result.stderr[-2000:]}")
        return json.loads((folder / "run" / "scale-worker0.json").read_text())["digest"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def worker_pid(host) -> int:
    """The worker process in ``host`` (its launcher's child running kspipe.cli.worker)."""
    for pid in processes_in(host.namespace):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kspipe.cli.worker" in command:
            return pid
    raise SystemExit(f"no worker process in {host.name}")


def killed(workers: int, servers: int, weights: int, mbit: float, env: dict) -> dict:
    """A sync job whose last worker is killed mid-training: what is left, and how fast."""
    folder = Path(tempfile.mkdtemp(prefix="kspipe-scale-kill-"))
    try:
        with Network(hosts=servers + workers, mbit=mbit) as network:
            hosts = network.hosts
            overrides = job_overrides(
                "sync", hosts, servers, weights=weights, steps=100_000, compute_ms=20
            )
            overrides += [f"tracking.uri={begun_store(folder)}", "cluster.timeout_s=900"]
            launchers = start_launchers(hosts, overrides, folder, env)
            first_log = folder / f"{hosts[servers].name}.log"
            deadline = time.monotonic() + 600
            while "train " not in (first_log.read_text() if first_log.exists() else ""):
                if time.monotonic() > deadline or any(p.poll() is not None for p in launchers):
                    raise SystemExit(f"the job did not start training:\n{first_log.read_text()}")
                time.sleep(0.5)
            time.sleep(3)
            victim = hosts[-1]
            os.kill(worker_pid(victim), signal.SIGKILL)
            at = time.monotonic()
            codes = [p.wait(timeout=300) for p in launchers]
            seconds = time.monotonic() - at
            left = {h.name: processes_in(h.namespace) for h in hosts}
        errors = [
            line
            for h in hosts
            for line in (folder / f"{h.name}.log").read_text().splitlines()
            if line.startswith("kspipe: error")
        ]
        return {
            "seconds": seconds,
            "codes": codes,
            "left": {name: pids for name, pids in left.items() if pids},
            "runs": run_statuses(folder / "mlflow.db"),
            "errors": errors,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--weights", type=int, default=100_000)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    site = Path(tempfile.mkdtemp(prefix="kspipe-scale-site-"))
    try:
        checks(args, plugin_environment(site))
    finally:
        shutil.rmtree(site, ignore_errors=True)


def checks(args, env: dict) -> None:
    n, m = args.workers, args.servers
    digests = [
        whole_job("sync", n, m, args.weights, args.mbit, env, args.steps)["digest"]
        for _ in range(2)
    ]
    digests.append(loopback_digest(n, m, args.weights, args.steps, env))
    print(f"sync, {n} workers, {m} servers: digests across hosts twice, then loopback: {digests}")
    if len(set(digests)) != 1:
        raise SystemExit("sync did not repeat bit for bit")
    result = killed(n, m, args.weights, args.mbit, env)
    print(
        f"a worker killed at {n} workers: every launcher ended {result['seconds']:.1f} s later "
        f"(exit codes {result['codes']}); processes left: {result['left'] or 'none'}; "
        f"MLflow runs: {result['runs']}"
    )
    for line in result["errors"]:
        print(f"  {line}")


if __name__ == "__main__":
    main()
