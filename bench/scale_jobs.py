"""Whole jobs at cluster scale on an emulated network (bench/bench_scale.py ``--jobs``).

Each process of a job gets a host of its own (tests/kit/network.py): the servers first,
then the workers, every host linked to one bridge at the same rate, and one ``kspipe``
launcher per host, as a user runs a job on machines (docs/distributed.md, "Across
machines").  The workload is the bench's own (bench/plugins/kspipe_scale): one dense
parameter of a chosen size, a small fixed compute a step, and the mode's real exchange.

Each worker times its steps between two barriers and writes the window; meanwhile every
host's link counters are read from the bridge's side five times a second, so a host's bytes
a step are what its link carried within worker 0's window, over the window's steps.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kspipe.testing.commands import install_plugin, plugin_env
from tests.kit.network import Network

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "bench" / "plugins" / "kspipe_scale"
SERVER_PORT, WORKER_PORT = 6000, 6100
SAMPLE_S = 0.2


def plugin_environment(site: Path) -> dict:
    """The environment of a ``kspipe`` command that loads the bench's workload, with the
    job's secret that every host of a job across hosts needs (kspipe/cluster/secret.py)."""
    if not (site / "kspipe_scale").exists():
        install_plugin(site, PLUGIN, "scale = kspipe_scale.plugin")
    env = plugin_env(site)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    env["KSPIPE_JOB_SECRET"] = secrets.token_hex(32)
    return env


class LinkCounters(threading.Thread):
    """Every host's link counters, read from the bridge's namespace every ``SAMPLE_S``:
    ``samples`` holds ``(time, {host: (sent, received)})`` (the host's side: what its port on
    the bridge received the host sent)."""

    def __init__(self, network: Network):
        super().__init__(daemon=True)
        self.network, self.samples, self.done = network, [], threading.Event()

    def read(self) -> tuple:
        out = subprocess.run(
            ["ip", "-n", self.network.bridge, "-j", "-s", "link"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        ports = {}
        for link in json.loads(out):
            if link["ifname"].startswith("h"):
                stats = link["stats64"]
                ports[link["ifname"]] = (stats["rx"]["bytes"], stats["tx"]["bytes"])
        return time.time(), ports

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append(self.read())
            self.done.wait(SAMPLE_S)

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.samples.append(self.read())

    def at(self, moment: float) -> dict:
        """Each host's counters at ``moment``, interpolated between the samples around it."""
        before = max((s for s in self.samples if s[0] <= moment), key=lambda s: s[0])
        after = min((s for s in self.samples if s[0] >= moment), key=lambda s: s[0])
        share = (moment - before[0]) / (after[0] - before[0]) if after[0] > before[0] else 0.0
        return {
            host: tuple(b + share * (a - b) for b, a in zip(before[1][host], after[1][host]))
            for host in before[1]
        }


def job_overrides(kind: str, hosts: list, servers: int, **scale) -> list[str]:
    """The ``kspipe`` overrides of a ``kind`` job whose first ``servers`` hosts serve and
    the rest work; ``scale`` sets the workload's keys (``weights``, ``steps`` ...)."""
    server_eps = [f"{h.address}:{SERVER_PORT}" for h in hosts[:servers]]
    worker_eps = [f"{h.address}:{WORKER_PORT}" for h in hosts[servers:]]
    mode = (
        ["mode=collective"]
        if kind == "collective"
        else ["mode=pserver", f"cluster.strategy={kind}", f"servers=[{','.join(server_eps)}]"]
    )
    return [
        "+experiment=scale",
        *mode,
        f"workers=[{','.join(worker_eps)}]",
        *(f"scale.{key}={value}" for key, value in scale.items()),
    ]


def start_launchers(hosts: list, overrides: list, folder: Path, env: dict) -> list:
    """One ``kspipe`` launcher a host, each with its run folder ``folder/<host>`` and its
    output in ``folder/<host>.log``."""
    kspipe = str(Path(sys.executable).with_name("kspipe"))
    launchers = []
    for host in hosts:
        with open(folder / f"{host.name}.log", "w") as log:
            launchers.append(
                host.popen(
                    [
                        kspipe,
                        *overrides,
                        f"cluster.host={host.address}",
                        f"run_dir={folder / host.name}",
                    ],
                    cwd=folder,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return launchers


def whole_job(
    kind: str,
    workers: int,
    servers: int,
    weights: int,
    mbit: float,
    env: dict,
    steps: int = 5,
    compute_ms: float = 0.0,
    extra: tuple = (),
    timeout_s: float = 900.0,
) -> dict:
    """One job (``kind``: sync, async, geo or collective) across ``servers + workers``
    hosts; its step time, bytes a step of its busiest worker and server hosts, digest."""
    servers = 0 if kind == "collective" else servers
    folder = Path(tempfile.mkdtemp(prefix="kspipe-scale-"))
    try:
        with Network(hosts=servers + workers, mbit=mbit) as network:
            hosts = network.hosts
            overrides = job_overrides(
                kind, hosts, servers, weights=weights, steps=steps, compute_ms=compute_ms
            )
            overrides += ["tracking.enabled=false", f"cluster.timeout_s={timeout_s}", *extra]
            counters = LinkCounters(network)
            counters.start()
            launchers = start_launchers(hosts, overrides, folder, env)
            deadline = time.monotonic() + timeout_s + 60
            for host, launcher in zip(hosts, launchers):
                if launcher.wait(timeout=max(deadline - time.monotonic(), 1)):
                    tail = (folder / f"{host.name}.log").read_text()[-2000:]
                    raise SystemExit(f"{kind} job, {host.name} failed:\n{tail}")
            counters.stop()
        windows = [
            json.loads(path.read_text()) for path in sorted(folder.glob("h*/scale-worker*.json"))
        ]
        first = next(w for w in windows if w["index"] == 0)
        start, end = counters.at(first["started"]), counters.at(first["ended"])
        per_step = {
            host: (end[host][0] - start[host][0] + end[host][1] - start[host][1]) / steps
            for host in start
        }
        server_names = [h.name for h in hosts[:servers]]
        worker_bytes = [b for h, b in per_step.items() if h not in server_names]
        server_bytes = [b for h, b in per_step.items() if h in server_names]
        return {
            "kind": kind,
            "workers": workers,
            "servers": servers,
            "weights": weights,
            "step_s": (first["ended"] - first["started"]) / steps,
            "worker_bytes": max(worker_bytes),
            "server_bytes": max(server_bytes, default=0.0),
            "digest": first["digest"],
            "exchange_s": {w["index"]: w.get("exchange_s", {}) for w in windows},
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_jobs(args) -> None:
    """bench_scale.py ``--jobs``: every job of the matrix its arguments give, printed as it
    ends (and appended to ``--out``), then plotted (``--plot``)."""
    with tempfile.TemporaryDirectory(prefix="kspipe-scale-site-") as site:
        jobs_in(args, plugin_environment(Path(site)))


def jobs_in(args, env: dict) -> None:
    sizes = [tuple(int(n) for n in size.split(":")) for size in args.sizes.split(",")]
    rows = []
    print(
        f"links at {args.mbit:g} Mbit/s each way, TCP {Network().congestion} on every host, "
        f"{args.steps} timed steps a job"
    )
    print(
        "job         weights  workers servers  step_s  vs_fewest  "
        "worker_MB/step  server_MB/step  digest"
    )
    for weights in [int(w) for w in args.weights.split(",")]:
        for kind in args.jobs.split(","):
            first = None
            seen = set()
            base, extra = variant(kind, args.k_steps)
            for workers, servers in sizes:
                servers = 0 if base == "collective" else servers
                if (workers, servers) in seen:
                    continue
                seen.add((workers, servers))
                row = whole_job(
                    base, workers, servers, weights, args.mbit, env, args.steps, extra=extra
                )
                row["kind"], row["mbit"] = kind, args.mbit
                row["shard_sum"] = (
                    base in ("sync", "geo") and "cluster.shard_sum=false" not in extra
                )
                first = first or row["step_s"]
                rows.append(row)
                print(
                    f"{kind:<10} {weights:>9}  {workers:>7} {servers:>7}  "
                    f"{row['step_s']:6.3f}  {row['step_s'] / first:8.2f}x  "
                    f"{row['worker_bytes'] / 1e6:14.2f}  {row['server_bytes'] / 1e6:14.2f}  "
                    f"{row['digest'] if base == 'sync' else ''}",
                    flush=True,
                )
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps(row) + "\n")
    if args.plot:
        plot_jobs(rows, args.plot, f"links at {args.mbit:g} Mbit/s, a host a process")
        print(f"plot: {args.plot}")


def variant(kind: str, k_steps: int) -> tuple:
    """A job kind of ``--jobs`` as a mode's kind and its extra overrides: ``sync-chain`` is
    sync summed along the workers' chain alone (no shard summers beside the servers),
    ``collective-gloo`` collective with its gradients summed through Paddle's gloo ops, the
    chain turned off (the workload's ``scale.chain=false``)."""
    if kind == "sync-chain":
        return "sync", ("cluster.shard_sum=false",)
    if kind == "collective-gloo":
        return "collective", ("scale.chain=false",)
    if kind == "geo":
        return "geo", (f"cluster.k_steps={k_steps}",)
    return kind, ()


def plot_jobs(rows: list[dict], path: str, title: str) -> None:
    """A panel a model size: each job's step time by workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["weights"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 4), squeeze=False)
    for ax, weights in zip(axes[0], sizes):
        for kind in dict.fromkeys(r["kind"] for r in rows):
            mine = sorted(
                (r for r in rows if r["kind"] == kind and r["weights"] == weights),
                key=lambda r: (r["workers"], r["servers"]),
            )
            ax.plot([r["workers"] for r in mine], [r["step_s"] for r in mine], "o-", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers (a host each; servers: half as many)")
        ax.set_ylabel("step, s")
        ax.set_title(f"{weights:,} weights", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
