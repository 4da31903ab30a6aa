"""A fault campaign: jobs killed, stopped and robbed of a checkpoint at random moments of
their life, and what came of each (issue 47; docs/distributed.md, "What survives what").

    python bench/faults.py --trials 40 --seed 1 [--kinds sync,sync-3,async,geo,collective]
                           [--launcher processes|slurm] [--json trials.json]

Each trial starts the tiny Reptile job (the embedded KanjiVG strokes, 24 meta-iterations, a
checkpoint every 4 of which 2 are kept) as a cluster of one kind, started by kspipe's own
launcher, as Slurm job steps (``--launcher slurm``: a one-node Slurm of its own on
loopback, tests/kit/slurm.py) or across emulated hosts (``--launcher hosts``,
bench/fault_hosts.py).  It picks at random a process (a worker, the server; across hosts
also the shard summer beside the server of a sync job of 3 workers, and the launcher of
worker 1's host), a moment (start-up, the first
steps, mid-training, while a checkpoint is written, after the last checkpoint, the final
evaluation and export) and a fault (SIGKILL, SIGSTOP, the newest checkpoint folder
removed), injects it there, and checks:

* with restarts left (``cluster.max_restarts=2``): exit 0, one FINISHED MLflow run, the final
  parameters of the uninterrupted job (bit for bit for sync and collective, whose sums run
  in a fixed order; async and geo within 3x the largest difference between two
  uninterrupted runs of theirs, plus 1e-6: their updates race), no process of the job left;
* out of restarts (the second trial of every four runs with none): exit not 0, one
  ``kspipe: error:``
  line naming the process, one FAILED run, within 30 s of the fault (a SIGSTOP: 30 s after
  the stall watch's ``cluster.stall_seconds``, 20 s here); a removed checkpoint is no
  process's fault: the job finishes.

A trial whose moment the job had passed before the fault could land (a process already
gone) is counted as missed, neither passed nor failed.  It prints a line per trial and the
table of BENCHMARKS.md ("Faults"); the suite runs a seeded handful
(tests/modes/test_faults.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))

from fault_sites import (  # noqa: E402
    EVERY,
    ITERATIONS,
    KINDS,
    STALL_S,
    Processes,
    launched,
)

from kspipe.testing import run_statuses, tiny_omniglot  # noqa: E402
from tests.kit import job_processes  # noqa: E402

EXACT = {"sync", "sync-3", "collective"}
MOMENTS = ["start-up", "first steps", "mid-training", "checkpoint write", "after last", "final"]
JOB_TIMEOUT_S = 420


def final_weights(run_dir: Path) -> dict:
    path = run_dir / "checkpoints" / f"checkpoint-{ITERATIONS:07d}" / "state.pdparams"
    with open(path, "rb") as f:
        return pickle.load(f)


def distance(a: dict, b: dict) -> float:
    """The largest absolute difference between two sets of parameters."""
    return max(float(np.max(np.abs(np.asarray(a[n]) - np.asarray(b[n])))) for n in a)


def text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def reached(moment: str, run_dir: Path) -> bool:
    """Whether the job is at ``moment`` of its life now."""
    saved = run_dir / "checkpoints"
    first_log = text(run_dir / "logs" / "worker.0.log")
    if moment == "start-up":
        return bool(job_processes(run_dir))
    if moment == "first steps":
        return "meta-train" in first_log
    if moment == "mid-training":
        return (saved / f"checkpoint-{ITERATIONS // 2:07d}").is_dir()
    if moment == "checkpoint write":
        return (
            any(saved.glob("checkpoint-*.tmp")) or (saved / f"checkpoint-{2 * EVERY:07d}").is_dir()
        )
    if moment == "after last":
        return (saved / f"checkpoint-{ITERATIONS:07d}").is_dir()
    return "evaluat" in first_log.rpartition("meta-train")[2]  # the final evaluation


def inject(site, fault: str, role: str, index: int, run_dir: Path) -> str | None:
    """The fault, now; what it hit (None: nothing to hit yet, or any more)."""
    if fault == "checkpoint removed":
        found = sorted(p for p in (run_dir / "checkpoints").glob("checkpoint-*") if not p.suffix)
        if not found:
            return None
        shutil.rmtree(found[-1], ignore_errors=True)
        return found[-1].name
    return site.inject(fault, role, index, run_dir)


def pick(number: int, rng: random.Random, kinds: list[str], site) -> dict:
    """Trial ``number``: the job's kind, the process, the moment, the fault, the restarts."""
    kind = rng.choice(kinds)
    role, index = rng.choice(site.roles(kind))
    fault = rng.choice(site.faults)
    if role == "launcher" and fault == "SIGSTOP":
        fault = "SIGKILL"  # a stopped launcher's processes would wait for it for ever
    # a checkpoint is removed once there is one
    moment = rng.choice(MOMENTS[2:] if fault == "checkpoint removed" else MOMENTS)
    restarts = 0 if number % 4 == 1 else 2
    return dict(trial=number, kind=kind, role=role, index=index, moment=moment, fault=fault,
                restarts=restarts)  # fmt: skip


def run_trial(plan: dict, data: Path, top: Path, site) -> dict:
    """Start the job, inject the fault at its moment, wait for the end; what was seen."""
    folder = top / f"trial-{plan['trial']}"
    run_dir = folder / "run"
    job = site.start(plan["kind"], folder, data, plan["restarts"])
    seen = dict(hit=None, fault_at=None, again_at=None)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while job.poll() is None and time.monotonic() < deadline:
            if seen["fault_at"] is None and reached(plan["moment"], run_dir):
                seen["hit"] = inject(site, plan["fault"], plan["role"], plan["index"], run_dir)
                seen["fault_at"] = time.monotonic() if seen["hit"] else None
            elif seen["fault_at"] and seen["again_at"] is None:
                restarted = (run_dir / "logs" / "attempt-1").is_dir()
                log = text(run_dir / "logs" / "worker.0.log")
                if restarted and ("resuming from" in log or "meta-train" in log):
                    seen["again_at"] = time.monotonic()  # set up again (its checkpoint loaded)
            time.sleep(0.05)
        if job.poll() is None:
            job.kill()
        seen["stderr"] = job.communicate()[1]
        seen["ended_at"] = time.monotonic()
        seen["left"] = job_processes(run_dir)
        seen["returncode"] = job.returncode
        seen["statuses"] = run_statuses(folder / "mlflow.db")
        try:
            seen["weights"] = final_weights(run_dir)
        except FileNotFoundError:
            seen["weights"] = None
    finally:
        for pid in job_processes(run_dir):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
    return seen


def judge(plan: dict, seen: dict, refs: dict, site) -> dict:
    """The trial's record: what was done, what came of it, passed or not and why."""
    kind, fault = plan["kind"], plan["fault"]
    process = f"{plan['role']} {plan['index']}"
    lost = site.loses_host(plan)  # then the job fails, naming that host
    record = dict(plan, process=process, hit=seen["hit"], passed=False, why="")
    fault_at = seen["fault_at"]
    record["seconds_to_training_again"] = (
        round(seen["again_at"] - fault_at, 1) if seen["again_at"] else None
    )
    record["seconds_fault_to_end"] = round(seen["ended_at"] - fault_at, 1) if fault_at else None
    errors = [line for line in seen["stderr"].splitlines() if line.startswith("kspipe: error:")]
    outcome = f"exit {seen['returncode']}, runs {seen['statuses']}, errors {errors[-1:]}"
    if seen["hit"] is None and (seen["returncode"] != 0 or seen["left"]):
        record["hit"] = "nothing"  # counted as failed: the job failed before any fault
        record["why"] = f"before the fault: {outcome}: {seen['stderr'][-800:]}"
    elif seen["hit"] is None:
        record["why"] = "missed: the job had gone past the moment"
    elif seen["left"]:
        record["why"] = f"processes left: {seen['left']}"
    elif (plan["restarts"] or fault == "checkpoint removed") and not lost:
        weights = seen["weights"]
        if weights is None and fault == "checkpoint removed":
            weights = refs[kind][0]  # it removed the final checkpoint: the run stands
        if seen["returncode"] != 0 or seen["statuses"] != ["FINISHED"] or weights is None:
            record["why"] = outcome if errors else f"{outcome}: {seen['stderr'][-500:]}"
        else:
            got = distance(weights, refs[kind][0])
            bound = 0.0 if kind in EXACT else 3 * refs[kind][1] + 1e-6
            record["distance"], record["passed"] = got, got <= bound
            record["why"] = "" if got <= bound else f"parameters {got:.3g} away (> {bound:.3g})"
    else:
        limit = 30 + (STALL_S if fault == "SIGSTOP" else 0) + site.extra_s(plan)
        record["passed"] = (
            seen["returncode"] != 0
            and len(errors) == 1
            and (lost or process) in errors[0]
            and seen["statuses"] == ["FAILED"]
            and record["seconds_fault_to_end"] <= limit
        )
        record["why"] = "" if record["passed"] else outcome
    return record


def references(kinds: list[str], data: Path, top: Path) -> dict:
    """Per kind: the uninterrupted job's final parameters, and the largest difference
    between two uninterrupted runs (0 where the sum is exact: one run), started by kspipe's
    own launcher on this host (on every launcher, the same job reaches the same parameters:
    tests/modes/test_slurm.py, test_emulated_hosts.py)."""
    refs = {}
    for kind in kinds:
        runs = []
        for n in range(1 if kind in EXACT else 2):
            folder = top / f"ref-{kind}-{n}"
            job = Processes().start(kind, folder, data, 0)
            _, stderr = job.communicate(timeout=JOB_TIMEOUT_S)
            if job.returncode != 0:
                raise SystemExit(f"the uninterrupted {kind} job failed: {stderr[-2000:]}")
            runs.append(final_weights(folder / "run"))
            shutil.rmtree(folder, ignore_errors=True)
        refs[kind] = (runs[0], distance(runs[0], runs[-1]))
        print(f"reference {kind}: two runs {refs[kind][1]:.3g} apart", flush=True)
    return refs


def table(records: list[dict]) -> str:
    """BENCHMARKS.md's table: trials, passed and missed by kind, fault, moment and process,
    and the time from the fault to the job set up again (its checkpoint loaded)."""
    rows = [
        "| | trials | passed | missed | training again (median, worst) |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(name, chosen):
        again = [r["seconds_to_training_again"] for r in chosen if r["seconds_to_training_again"]]
        timing = f"{statistics.median(again):.1f} s, {max(again):.1f} s" if again else "-"
        passed = sum(r["passed"] for r in chosen)
        missed = sum(r["hit"] is None for r in chosen)
        rows.append(f"| {name} | {len(chosen)} | {passed} | {missed} | {timing} |")

    for key in ("kind", "fault", "moment", "process", "restarts"):
        for value in sorted({r[key] for r in records}):
            row(f"{key} {value}", [r for r in records if r[key] == value])
    row("all", records)
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--launcher", choices=["processes", "slurm", "hosts"], default="processes")
    parser.add_argument("--json", help="write every trial to this file")
    parser.add_argument("--only", help="run only these trials of the seed's (e.g. 5,9)")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: no kind {', '.join(unknown)} (there are {', '.join(KINDS)})")
    rng = random.Random(args.seed)
    records = []
    with tempfile.TemporaryDirectory(prefix="kspipe-faults-") as tmp:
        top = Path(tmp)
        data = tiny_omniglot(top / "kanji")
        refs = references(kinds, data, top)
        with launched(args.launcher, top) as site:
            only = {int(n) for n in args.only.split(",")} if args.only else None
            for number in range(args.trials):
                plan = pick(number, rng, kinds, site)
                if only is not None and number not in only:
                    continue
                record = judge(plan, run_trial(plan, data, top, site), refs, site)
                records.append(record)
                print(json.dumps(record), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print(table(records))
    failed = [r for r in records if not r["passed"] and r["hit"] is not None]
    missed = sum(r["hit"] is None for r in records)
    print(f"{len(records) - len(failed) - missed} of {len(records)} trials passed, {missed} missed")
    for record in failed:
        print(f"failed: trial {record['trial']}: {record['why']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
