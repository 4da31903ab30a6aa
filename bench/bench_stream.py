"""A generated day-by-day stream on 2 workers and 2 servers (issue 48, point 9).

    python bench/bench_stream.py [--days 10] [--lines 2000] [--rounds 8] [--out /tmp/bench-stream]

writes a PaddleRec online layout (``kspipe.ctr.stream.generated``: Zipf ids whose popular
set drifts every day, about half of them at or above 2**63), then runs ``+experiment=ctr_stream``
three times a round on it:

* ``raw+evict``: raw ids, rows unseen for more than ``--unseen-days`` days deleted at a
  day's end;
* ``raw``: raw ids, nothing deleted;
* ``hashed``: ids hashed to 2**18 rows a slot (``ctr.ids=hashed``), nothing deleted.

For each it reads the run's lines and the servers' memory (their resident set, read at
each base save) and prints, as markdown: rows held and server memory per day (first
round), AUC per pass (validated before training on it), samples per second, delta save
time per pass and its share of a pass, base save time per day; then the pairs.

**Rounds and pairs.**  A run's AUC is not reproducible, and no setting makes it so: one
worker, one reader thread and one server still give another AUC each run (the async
communicator of Paddle's the_one_ps sends gradients and pulls the tower's parameters on
threads of its own, so what a batch sees depends on timing; new rows are drawn at random
on the servers).  So each run is made ``--rounds`` times, the three in another order each
round, and compared with the others of its round: eviction minus none, raw minus hashed;
the report gives the mean of the differences and its standard error.

**Learning rates.**  The tables' rows take the servers' Adam rule at ``--sparse-lr``
(0.05), the tower ``ctr.learning_rate`` (``--lr``, 0.002).  With 0.002 for both, a row
moves at most 0.002 a batch holding it (Adam's step): about 0.03 over a pass, against a
random start in +-0.05, so the rows learnt little before their ids faded and a run's mean
AUC (0.55-0.60) was mostly spread.  With 0.01 for both, some runs' towers died: the
ReLUs' biases, pushed down while the prediction fell to the CTR, passed below anything
inputs of +-0.05 reach; a dead unit has no gradient, and with every unit of a layer dead
the prediction is the CTR (AUC 0.5).  The data has the signal: its own probabilities
score 0.78-0.84 a pass, an online per-id click counter 0.69.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
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
#: the pairs compared round by round: (first, second), their AUC's difference
PAIRS = [("raw+evict", "raw"), ("raw", "hashed")]
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


def run(name: str, overrides: list, args, logs: Path, rnd: int) -> dict:
    run_dir = args.out / f"{name.replace('+', '-')}-{rnd}"
    shutil.rmtree(run_dir, ignore_errors=True)
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
        f"ctr.learning_rate={args.lr}",
        *(
            f"ctr.table.accessor.{p}_sgd_param.adam.learning_rate={args.sparse_lr}"
            for p in ("embed", "embedx")
        ),
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
    found["passes_run"] = metrics["passes"]
    if not args.keep:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return found


def mean_se(values: list) -> tuple:
    """The mean of ``values`` and its standard error (0 for one value)."""
    n = len(values)
    m = sum(values) / n
    sd = (sum((v - m) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return m, sd / n**0.5, sd


def summary(r: dict) -> dict:
    """One run's figures: mean AUC before training (passes 2+), rates, save times."""
    tests, deltas = list(r["tests"].values()), list(r["deltas"].values())
    pass_s = r["train_seconds"] / max(r["passes_run"], 1)
    delta = sum(deltas) / max(len(deltas), 1)
    return {
        "auc": sum(tests) / len(tests),
        "samples_per_s": r["samples_per_s"],
        "delta_s": delta,
        "base_s": sum(b[1] for b in r["bases"]) / len(r["bases"]),
        "pass_s": pass_s,
        "delta_share": delta / pass_s,
    }


def report(results: dict, args) -> str:
    """Markdown: rows and memory a day (first round), AUC a pass (mean over rounds), each
    run's figures (mean and spread over rounds), and the paired differences."""
    rounds = len(next(iter(results.values())))
    out = [
        f"Days {len(args.days_list)}, 2 passes a day of {2 * args.lines} lines, 2 workers, "
        f"2 servers, ctr.learning_rate {args.lr}, sparse Adam learning rate {args.sparse_lr}, "
        f"{rounds} round(s).",
        "",
        "| day | " + " | ".join(f"{n} rows | {n} servers MiB" for n in results) + " |",
        "| --- |" + " --- | --- |" * len(results),
    ]
    for k, day in enumerate(args.days_list):
        cells = []
        for runs in results.values():
            cells += [str(runs[0]["bases"][k][2]), f"{runs[0]['memory'][k]:.0f}"]
        out.append(f"| {day} | " + " | ".join(cells) + " |")
    out += ["", "| pass | " + " | ".join(f"{n} AUC before training" for n in results) + " |"]
    out += ["| --- |" + " --- |" * len(results)]
    for p in sorted(next(iter(results.values()))[0]["tests"]):
        cells = [mean_se([r["tests"][p] for r in runs])[0] for runs in results.values()]
        out.append(f"| {p} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    out += [
        "",
        "| run | mean AUC (passes 2+), its SD over rounds | samples/s | delta save s "
        "| base save s | pass s (all included) | delta save / pass |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    sums = {name: [summary(r) for r in runs] for name, runs in results.items()}
    for name, rows in sums.items():
        auc_m, _, auc_sd = mean_se([x["auc"] for x in rows])
        cells = [f"{auc_m:.4f} (SD {auc_sd:.4f})"]
        for key, fmt in (("samples_per_s", "{:.0f}"), ("delta_s", "{:.3f}"), ("base_s", "{:.3f}")):
            cells.append(fmt.format(mean_se([x[key] for x in rows])[0]))
        cells.append(f"{mean_se([x['pass_s'] for x in rows])[0]:.2f}")
        cells.append(f"{100 * mean_se([x['delta_share'] for x in rows])[0]:.1f}%")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| paired, over rounds | mean | standard error | pairs |",
        "| --- | --- | --- | --- |",
    ]
    for a, b in PAIRS:
        if a in sums and b in sums:
            n = min(len(sums[a]), len(sums[b]))
            diff = [sums[a][k]["auc"] - sums[b][k]["auc"] for k in range(n)]
            m, se, _ = mean_se(diff)
            out.append(f"| AUC {a} minus {b} | {m:+.4f} | {se:.4f} | {n} |")
            ratio = [sums[a][k]["samples_per_s"] / sums[b][k]["samples_per_s"] for k in range(n)]
            m, se, _ = mean_se(ratio)
            out.append(f"| samples/s {a} over {b} | {m:.3f}x | {se:.3f} | {n} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=int, default=10)
    parser.add_argument("--lines", type=int, default=2000, help="lines a folder (2 folders a pass)")
    parser.add_argument("--unseen-days", type=int, default=2)
    parser.add_argument("--start", default="20190720")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--rounds", type=int, default=1, help="each run this many times")
    parser.add_argument("--lr", type=float, default=0.002, help="ctr.learning_rate (the tower)")
    parser.add_argument("--sparse-lr", type=float, default=0.05, help="the tables' Adam rule")
    parser.add_argument("--keep", action="store_true", help="keep each run's checkpoints")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-stream"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    folders = ["0000", "0600", "1200", "1800"]
    args.days_list = write_stream(str(logs), args.start, args.days, folders, args.lines, seed=1)
    names = args.runs.split(",")
    results = {name: [] for name in names}
    for rnd in range(args.rounds):
        shift = rnd % len(names)  # each run first in turn: a drift of the machine's load
        for name in names[shift:] + names[:shift]:  # falls on every run alike
            found = run(name, RUNS[name], args, logs, rnd)
            results[name].append(found)
            line = {"round": rnd, "name": name, **summary(found), "tests": found["tests"]}
            with open(args.out / "runs.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            print(json.dumps({k: v for k, v in line.items() if k != "tests"}), flush=True)
        text = report(results, args)  # after every round: a campaign cut short still tells
        (args.out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
