"""A generated day-by-day stream on 2 workers and 2 servers (issue 48, point 9).

    python bench/bench_stream.py [--days 10] [--lines 2000] [--out /tmp/bench-stream]

writes a PaddleRec online layout (``kspipe.ctr.stream.generated``: Zipf ids whose popular
set drifts every day, ids of one slot above 2**63), then runs ``+experiment=ctr_stream``
three times on it:

* ``raw+evict``: raw ids, rows unseen for more than ``--unseen-days`` days deleted at a
  day's end;
* ``raw``: raw ids, nothing deleted;
* ``hashed``: ids hashed to 2**18 rows a slot (``ctr.ids=hashed``), nothing deleted.

For each it reads the run's lines and the servers' memory (their resident set, read at
each base save) and prints, as markdown: rows held and server memory per day, AUC per pass
(validated before training on it), samples per second, delta save time per pass and base
save time per day.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kspipe.ctr.stream.generated import write_stream  # noqa: E402

RUNS = {
    "raw+evict": ["ctr.ids=raw"],
    "raw": ["ctr.ids=raw"],
    "hashed": ["ctr.ids=hashed", "ctr.hash_size=262144"],
}
PASS_LINE = re.compile(r"kspipe: pass (\d+): .* auc ([0-9.]+),")
TEST_LINE = re.compile(r"kspipe: pass (\d+), before training on it: (\d+) instances, auc ([0-9.]+)")
SAVE_LINE = re.compile(
    r"kspipe: (delta|base) checkpoint-\d+ after pass (\d+) in ([0-9.]+) s; tables hold (\d+) rows"
)


def server_rss_mib(run_dir: Path) -> float:
    """The parameter servers' resident memory, summed (MiB)."""
    pids = subprocess.run(
        ["pgrep", "-f", re.escape(f"kspipe.cli.worker {run_dir}")], capture_output=True, text=True
    ).stdout.split()
    total = 0.0
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if b"TRAINING_ROLE=PSERVER" not in env:
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def run(name: str, overrides: list, args, logs: Path) -> dict:
    run_dir = args.out / name
    command = [
        sys.executable,
        "-m",
        "kspipe.cli.command",
        "+experiment=ctr_stream",
        "workers=2",
        "servers=2",
        f"run_dir={run_dir}",
        f"tracking.uri=sqlite:///{args.out / 'mlflow.db'}",
        f"ctr.stream.root={logs}",
        f"ctr.stream.start_day={args.start}",
        f"ctr.stream.end_day={args.days_list[-1]}",
        "ctr.stream.split_interval=360",
        "ctr.stream.split_per_pass=2",
        "datafeed.format=slot",
        "datafeed.batch_size=256",
        "cluster.timeout_s=600",
        *overrides,
    ]
    if name.endswith("evict"):
        command.append(
            f"ctr.table.accessor.ctr_accessor_param.delete_after_unseen_days={args.unseen_days}"
        )
    found = {"passes": {}, "tests": {}, "deltas": {}, "bases": [], "memory": []}
    started = time.perf_counter()
    job = subprocess.Popen(command, cwd=args.out, stderr=subprocess.PIPE, text=True)
    for line in job.stderr:
        if m := PASS_LINE.match(line):
            found["passes"][int(m[1])] = float(m[2])
        elif m := TEST_LINE.match(line):
            found["tests"][int(m[1])] = float(m[3])
        elif m := SAVE_LINE.match(line):
            if m[1] == "delta":
                found["deltas"][int(m[2])] = float(m[3])
            else:
                found["bases"].append((int(m[2]), float(m[3]), int(m[4])))
                found["memory"].append(server_rss_mib(run_dir))
    job.wait()
    if job.returncode != 0:
        raise SystemExit(f"{name}: the stream failed; its logs: {run_dir / 'logs'}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    found["samples_per_s"] = metrics["samples_per_s"]
    found["train_seconds"] = metrics["train_seconds"]
    found["wall"] = time.perf_counter() - started
    return found


def report(results: dict, args) -> str:
    out = [
        f"Days {len(args.days_list)}, 2 passes a day of {2 * args.lines} lines, "
        "2 workers, 2 servers.",
        "",
    ]
    out += ["| day | " + " | ".join(f"{n} rows | {n} servers MiB" for n in results) + " |"]
    out += ["| --- |" + " --- | --- |" * len(results)]
    for k, day in enumerate(args.days_list):
        cells = []
        for r in results.values():
            _, _, rows = r["bases"][k]
            cells += [str(rows), f"{r['memory'][k]:.0f}"]
        out.append(f"| {day} | " + " | ".join(cells) + " |")
    out += ["", "| pass | " + " | ".join(f"{n} AUC before training" for n in results) + " |"]
    out += ["| --- |" + " --- |" * len(results)]
    for p in sorted(next(iter(results.values()))["tests"]):
        out.append(
            f"| {p} | "
            + " | ".join(f"{r['tests'].get(p, float('nan')):.4f}" for r in results.values())
            + " |"
        )
    out += [
        "",
        "| run | mean AUC (passes 2+) | samples/s | delta save s (mean a pass) "
        "| base save s (mean a day) | pass s (mean) |",
    ]
    out += ["| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        tests = list(r["tests"].values())
        deltas = list(r["deltas"].values())
        passes = max(len(r["passes"]), 1)
        out.append(
            f"| {name} | {sum(tests) / len(tests):.4f} | {r['samples_per_s']:.0f} | "
            f"{sum(deltas) / len(deltas):.3f} | "
            f"{sum(b[1] for b in r['bases']) / len(r['bases']):.3f} | "
            f"{r['train_seconds'] / passes:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=int, default=10)
    parser.add_argument("--lines", type=int, default=2000, help="lines a folder (2 folders a pass)")
    parser.add_argument("--unseen-days", type=int, default=2)
    parser.add_argument("--start", default="20190720")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-stream"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    folders = ["0000", "0600", "1200", "1800"]
    args.days_list = write_stream(str(logs), args.start, args.days, folders, args.lines, seed=1)
    results = {name: run(name, RUNS[name], args, logs) for name in args.runs.split(",")}
    text = report(results, args)
    print(text)
    (args.out / "report.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
