"""Sync rounds at cluster scale, on an emulated network: each worker a host of its own
(a network namespace with its own address), every host linked to one bridge at a chosen
bandwidth (tests/kit/network.py; root only).

    python bench/bench_scale.py --workers 2,4,8,16 --mbit 200 --floats 1000000 \
        --against 8206396 --plot docs/scale.png
    python bench/bench_scale.py --engines chain,gloo --shards 4:2,8:4,16:8 --mbit 50 \
        --floats 8192,131072,1048576,4194304 --seconds 6 --out engines.json

For each size of ``--floats`` and each number of workers, and for this checkout's sum
(``chain``), a revision's (``--against``: 8206396 is the hub the chain replaced) and
Paddle's gloo (``gloo`` in ``--engines``: the ring all-reduce of the collective mode's CPU
ops), the workers sum an array of that many float64 values ``--rounds`` times (more, up to
``--seconds`` of timed rounds as the links' rate predicts) (bench/sum_worker.py), and, for
each ``workers:servers`` of ``--shards``, through the sync rounds' sum (the chain and a
shard summer beside each server, each server a host of its own: sharded.py): the exchange
is the real one, and the workers compute nothing else, so the links bound a round unless
the cores do.  Printed per job: a round's time (the timed rounds' time over their number,
the slowest worker's), the bytes each host sent and received per round (its link's
counters: the busiest host's and the median host's), the round's time against the same
sum's at the fewest workers, how busy the machine's cores were while worker 0 timed its
rounds (every process's, this bench's and anyone else's: near 100% the cores, not the
links, may bound the round) and the share of the cores' time the workers themselves took.
Every job's sum is checked against the workers' arrays added in worker order (the chain's
bit for bit, gloo's ring within rounding).  First, the
bridge's own limit (two hosts, links not shaped), so the links' rate can be kept below what
the cores can carry for every link at once.

``--jobs`` measures whole jobs instead (bench/scale_jobs.py): ``kspipe`` jobs of the bench's
workload (bench/plugins/kspipe_scale: one dense parameter of ``--weights`` float32 values, a
small fixed compute a step), each server and worker on a host of its own, for the modes and
strategies listed, at each ``workers:servers`` of ``--sizes``:

    python bench/bench_scale.py --jobs sync,async,geo,collective --sizes 2:1,4:2,8:4,16:8 \
        --weights 10000,112451,4000000 --mbit 100 --out scale.json --plot docs/scale-jobs.png

Printed per job: a step's time (worker 0's window between two barriers over its steps),
the bytes a step of the busiest worker host and the busiest server host, the step against
the same job's at the fewest workers, and, for sync, the digest of the final parameters
(each job's own: the same job run again gives the same).  ``collective-gloo`` is the
collective job with the workers' chain turned off: its gradients summed through Paddle's
gloo ops (an all-gather where the buffer's bytes x (workers - 1) are at most 64 KiB, else
the ring all-reduce, kspipe/modes/fused.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.kit.network import Network  # noqa: E402

WORKER = os.path.join(ROOT, "bench", "sum_worker.py")
LABELS = {
    "chain": "chain (this checkout)",
    "shards": "chain and shard summers",
    "gloo": "gloo's ring all-reduce (Paddle)",
}
BOOK_PORT = 7090  # the meeting point's, on the first server's host, for --shards
BLAST = """
import socket, sys, time
if sys.argv[1] == "serve":
    with socket.create_server((sys.argv[2], 7200)) as s:
        peer, _ = s.accept()
        got = 0
        while chunk := peer.recv(1 << 20):
            got += len(chunk)
        print(got)
else:
    for _ in range(100):
        try:
            link = socket.create_connection((sys.argv[2], 7200)); break
        except OSError:
            time.sleep(0.05)
    block, started = b"x" * (1 << 20), time.perf_counter()
    while time.perf_counter() - started < 3:
        link.sendall(block)
    link.close()
"""


def counters(host) -> tuple[int, int]:
    """Bytes ``host``'s link has sent and received."""
    out = host.run(
        ["ip", "-j", "-s", "link", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def bridge_limit() -> float:
    """Gbit/s one TCP stream moves between two hosts whose links are not shaped."""
    with Network(hosts=2, mbit=100_000) as net:
        server, client = net.hosts
        serving = server.popen(
            [sys.executable, "-c", BLAST, "serve", server.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        started = time.perf_counter()
        client.run([sys.executable, "-c", BLAST, "send", server.address], check=True)
        got = int(serving.communicate(timeout=30)[0])
        return got * 8 / (time.perf_counter() - started) / 1e9


class Cores(threading.Thread):
    """The machine's CPU time, busy and all, read from /proc/stat every 0.1 s."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples, self.done = [], threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            with open("/proc/stat") as stat:
                ticks = [int(t) for t in stat.readline().split()[1:]]
            self.samples.append((time.time(), sum(ticks) - ticks[3] - ticks[4], sum(ticks)))
            self.done.wait(0.1)

    def busy(self, start: float, end: float) -> float:
        """The share of the cores' time that was busy between ``start`` and ``end``."""
        self.done.set()
        self.join()
        inside = [s for s in self.samples if start <= s[0] <= end] or self.samples[-2:]
        first, last = inside[0], inside[-1]
        return (last[1] - first[1]) / max(last[2] - first[2], 1)


def expected_sum(workers: int, floats: int) -> np.ndarray:
    """The workers' arrays (sum_worker.py's) added in worker order."""
    total = np.zeros(floats)
    for index in range(workers):
        total += np.random.default_rng(index).standard_normal(floats)
    return total


def job(workers: int, mbit: float, floats: int, rounds: int, which: str, servers=0) -> dict:
    """One job's round times and bytes per round (``servers``: hosts of their own, each
    with a shard summer, for ``which`` = ``shards``)."""
    saved = tempfile.NamedTemporaryFile(suffix=".npy", delete=False).name
    with Network(hosts=servers + workers, mbit=mbit) as net:
        serving, working = net.hosts[:servers], net.hosts[servers:]
        env = dict(os.environ, SUM_WORKERS=",".join(h.address for h in working), SUM_SAVE=saved)
        env["KSPIPE_JOB_SECRET"] = secrets.token_hex(32)  # what every link's greeting shows
        addresses = env["SUM_WORKERS"]
        started = []  # the book and the summers: each ends when its standard input closes
        if servers:
            env["SUM_SERVERS"] = ",".join(h.address for h in serving)
            env.update(meeting_point(serving[0], servers + workers, env, started))
            for s, host in enumerate(serving):
                command = [sys.executable, WORKER, "serve", str(s), str(floats)]
                started.append(host.popen(command, stdin=subprocess.PIPE, env=env, cwd=ROOT))
        before = [counters(h) for h in net.hosts]
        cores = Cores()
        command = [str(floats), str(rounds), which]
        running = [
            h.popen(
                [sys.executable, WORKER, str(i), addresses, *command],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=env,
            )
            for i, h in enumerate(working)
        ]
        results = []
        for process in running:
            out, _ = process.communicate(timeout=3600)
            if process.returncode:
                raise SystemExit(f"a worker of the {which} job failed ({process.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
        after = [counters(h) for h in net.hosts]
        for process in started:
            process.stdin.close()
            process.wait(timeout=60)
    if len({r["digest"] for r in results}) != 1:
        raise SystemExit(f"the {which} job's workers hold different sums")
    error = float(np.max(np.abs(np.load(saved) - expected_sum(workers, floats))))
    os.unlink(saved)
    if error > 1e-9:
        raise SystemExit(f"the {which} job's sum is off by up to {error:g}")
    # a round's time is the timed rounds' wall-clock time over their number, the slowest
    # worker's: a worker that ends a round early starts the next one early, so one round's
    # own time would hide what the links carry for the others
    per_round = max(sum(r["seconds"]) for r in results) / rounds
    moved = [(a[0] - b[0] + a[1] - b[1]) / (rounds + 1) for a, b in zip(after, before)]
    return {
        "workers": workers,
        "servers": servers,
        "sum": which,
        "round_s": per_round,
        "busiest_bytes": max(moved[servers:]),
        "median_bytes": statistics.median(moved[servers:]),
        "server_bytes": max(moved[:servers], default=0.0),
        "digest": results[0]["digest"],
        "exact": error == 0.0,
        "rounds": rounds,
        "cpu_busy": cores.busy(results[0]["started"], results[0]["ended"]),
        # the workers' own CPU time over the cores' time in the round (summers not counted)
        "workers_cpu": sum(r["cpu_s"] for r in results) / (rounds * per_round * os.cpu_count()),
    }


def meeting_point(host, members: int, env: dict, started: list) -> dict:
    """The job's address book on ``host`` (where the summers are announced), and the
    environment that names it to the job's processes."""
    book = host.popen(
        [sys.executable, "-m", "kspipe.cluster.addresses", str(BOOK_PORT), host.address,
         str(members)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    started.append(book)
    if book.stdout.readline().strip() != "ready":
        raise SystemExit("the sum's meeting point did not start")
    return {
        "PADDLE_GLOO_RENDEZVOUS": "3",
        "PADDLE_GLOO_HTTP_ENDPOINT": f"{host.address}:{BOOK_PORT}",
    }


def series(row: dict) -> tuple:
    servers = row.get("servers", 0)
    return row["sum"], row["workers"] / servers if servers else 0


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in dict.fromkeys(series(r) for r in rows):  # the shards: a line per N / M
        mine = [r for r in rows if series(r) == key]
        which, per_server = key
        label = LABELS.get(which, f"hub ({which})")
        ax.plot(
            [r["workers"] for r in mine],
            [r["round_s"] for r in mine],
            "o-",
            label=f"{label}, N/{per_server:g} servers" if per_server else label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers (a host each)")
    ax.set_ylabel("sync round, s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument("--mbit", type=float, default=200.0)
    parser.add_argument("--floats", default="1000000", help="the arrays' sizes, ...")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, at least")
    parser.add_argument("--seconds", type=float, default=0.0, help="timed rounds' time, about")
    parser.add_argument("--engines", default="chain", help="the sums: chain,gloo")
    parser.add_argument("--against", default="", help="a git revision's sum to compare")
    parser.add_argument("--plot", default="", help="a PNG of round time by workers")
    parser.add_argument(
        "--jobs",
        default="",
        help="whole jobs: sync,sync-chain,async,geo,collective,collective-gloo",
    )
    parser.add_argument("--sizes", default="2:1,4:2,8:4,16:8", help="workers:servers, ...")
    parser.add_argument(
        "--shards", default="", help="sync rounds' sums with shard summers: workers:servers, ..."
    )
    parser.add_argument("--weights", default="1000000", help="the model's sizes, ...")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--k-steps", type=int, default=4, help="geo's steps a round")
    parser.add_argument("--out", default="", help="the jobs' rows as JSON (appended)")
    args = parser.parse_args()
    if args.jobs:
        from bench.scale_jobs import run_jobs

        run_jobs(args)
        return
    print(f"bridge's limit, one stream, links not shaped: {bridge_limit():.2f} Gbit/s", flush=True)
    counts = [int(n) for n in args.workers.split(",") if n]
    engines = [e for e in args.engines.split(",") if e] + [args.against] * bool(args.against)
    runs = [(which, n, 0) for which in engines for n in counts]
    for size in filter(None, args.shards.split(",")):
        runs.append(("shards", *(int(n) for n in size.split(":"))))
    runs.sort(key=lambda run: run[1])  # the sums of a size side by side: the same load
    print(f"links at {args.mbit:g} Mbit/s each way, TCP {Network().congestion} on every host")
    rows = []
    for floats in [int(n) for n in args.floats.split(",") if n]:
        rows += sums_of_size(args, floats, runs)
    if any(not r["exact"] for r in rows if r["sum"] != "gloo"):
        raise SystemExit("a chain's sum is not the workers' arrays added in worker order")
    print("every job's workers hold the same sum; the chains' are the workers' arrays added in "
          "worker order, bit for bit, gloo's within rounding")  # fmt: skip
    if args.plot:
        floats = rows[-1]["floats"]
        title = f"{floats * 8 / 2**20:.0f} MiB float64 a round, links at {args.mbit:g} Mbit/s"
        plot([r for r in rows if r["floats"] == floats], args.plot, title)
        print(f"plot: {args.plot}")


def sums_of_size(args, floats: int, runs: list) -> list[dict]:
    """Every job of ``runs`` with arrays of ``floats`` float64, printed as it ends."""
    print(f"{floats:,} float64 ({floats * 8 / 2**20:g} MiB) a round")
    print("sum       workers servers  rounds  round_s  vs_fewest  busiest_worker_MB  "
          "median_worker_MB  busiest_server_MB  cores_busy  workers'")  # fmt: skip
    rows, first = [], {}
    link = args.mbit * 1e6 / 8
    for which, workers, servers in runs:
        # a round's bytes each way on the busiest link are at most 2 S (a chain's middle)
        predicted = floats * 8 * (1 if workers == 2 else 2) / link + 0.002 * workers
        rounds = max(args.rounds, min(300, math.ceil(args.seconds / predicted)))
        row = job(workers, args.mbit, floats, rounds, which, servers)
        row.update(mbit=args.mbit, floats=floats)
        first.setdefault(which, row["round_s"])
        rows.append(row)
        print(
            f"{which:<9} {workers:>7} {servers:>7}  {rounds:>6}  {row['round_s']:7.3f}  "
            f"{row['round_s'] / first[which]:8.2f}x  {row['busiest_bytes'] / 1e6:17.2f}  "
            f"{row['median_bytes'] / 1e6:16.2f}  {row['server_bytes'] / 1e6:17.2f}  "
            f"{row['cpu_busy']:9.0%}  {row['workers_cpu']:8.0%}",
            flush=True,
        )
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
