"""A fault campaign: jobs killed, stopped and robbed of a checkpoint at random moments of
their life, and what came of each (issue 47; docs/distributed.md, "What survives what").

    python bench/faults.py --trials 40 --seed 1 [--kinds sync,sync-3,async,geo,collective]
                           [--launcher processes|slurm] [--json trials.json]

Each trial starts the tiny Reptile job (the embedded KanjiVG strokes, 24 meta-iterations, a
checkpoint every 4 of which 2 are kept) as a cluster of one kind, started by kspipe's own
launcher or as Slurm job steps (``--launcher slurm``: a one-node Slurm of its own on
loopback, tests/kit/slurm.py).  It picks at random a process (a worker, the server, the
shard summer beside the server of a sync job of 3 workers), a moment (start-up, the first
steps, mid-training, while a checkpoint is written, after the last checkpoint, the final
evaluation and export) and a fault (SIGKILL, SIGSTOP, the newest checkpoint folder
removed), injects it there, and checks:

* with restarts left (``cluster.max_restarts=2``): exit 0, one FINISHED MLflow run, the final
  parameters of the uninterrupted job (bit for bit for sync and collective, whose sums run
  in a fixed order; async and geo within 3x the largest difference between two
  uninterrupted runs of theirs, plus 1e-6: their updates race), no process of the job left;
* out of restarts (the second trial of every four runs with none): exit not 0, one ``kspipe: error:``
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
import contextlib
import json
import os
import pickle
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))

from kspipe.testing import run_statuses, tiny_omniglot, tiny_overrides  # noqa: E402

ITERATIONS, EVERY, KEEP, STALL_S = 24, 4, 2, 20
KINDS = {
    "sync": ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=sync"],
    "sync-3": ["mode=pserver", "workers=3", "servers=1", "cluster.strategy=sync"],
    "async": ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=async"],
    "geo": ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=geo", "cluster.k_steps=2"],
    "collective": ["mode=collective", "workers=2"],
}
EXACT = {"sync", "sync-3", "collective"}
MOMENTS = ["start-up", "first steps", "mid-training", "checkpoint write", "after last", "final"]
FAULTS = ["SIGKILL", "SIGSTOP", "checkpoint removed"]
JOB_TIMEOUT_S = 420


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


def start(kind: str, folder: Path, data: Path, restarts: int, slurm=None) -> subprocess.Popen:
    """The job, started by kspipe's own launcher, or by ``salloc`` (``slurm``: the local
    Slurm's environment) as job steps of an allocation of one task a process."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kspipe.cli.command", *overrides(kind, folder, data, restarts)]
    if slurm is not None:
        counts = [o.partition("=")[2] for o in KINDS[kind] if o.startswith(("workers", "servers"))]
        tasks = sum(int(n) for n in counts)
        command = ["salloc", "-n", str(tasks), "--quiet", *command, "cluster.launcher=slurm"]
    return subprocess.Popen(
        command,
        env=dict(os.environ, **(slurm or {})),
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def final_weights(run_dir: Path) -> dict:
    path = run_dir / "checkpoints" / f"checkpoint-{ITERATIONS:07d}" / "state.pdparams"
    with open(path, "rb") as f:
        return pickle.load(f)


def distance(a: dict, b: dict) -> float:
    """The largest absolute difference between two sets of parameters."""
    return max(float(np.max(np.abs(np.asarray(a[n]) - np.asarray(b[n])))) for n in a)


def processes(run_dir: Path) -> list[int]:
    """The job's processes still running (every role runs ``kspipe.cli.worker <run_dir>``)."""
    out = subprocess.run(
        ["pgrep", "-f", f"kspipe.cli.worker {run_dir}"], capture_output=True, text=True
    ).stdout.split()
    return [int(pid) for pid in out]


def role_pid(run_dir: Path, role: str, index: int) -> int | None:
    """The pid of the job's ``role`` ``index`` (a worker, the server, the server's shard
    summer), if it runs (the role itself, not the ``srun`` that started it)."""
    if role == "summer":
        server = role_pid(run_dir, "server", 0)
        out = subprocess.run(
            ["pgrep", "-P", str(server or 0), "-f", "kspipe.modes.ps.summer"],
            capture_output=True,
            text=True,
        ).stdout.split()
        return int(out[0]) if out else None
    for pid in processes(run_dir):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"srun"):
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        server = b"TRAINING_ROLE=PSERVER" in env
        if server if role == "server" else f"PADDLE_TRAINER_ID={index}".encode() in env:
            return pid
    return None


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
        return bool(processes(run_dir))
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


def inject(fault: str, role: str, index: int, run_dir: Path) -> str | None:
    """The fault, now; what it hit (None: nothing to hit yet, or any more)."""
    if fault == "checkpoint removed":
        found = sorted(p for p in (run_dir / "checkpoints").glob("checkpoint-*") if not p.suffix)
        if not found:
            return None
        shutil.rmtree(found[-1], ignore_errors=True)
        return found[-1].name
    pid = role_pid(run_dir, role, index)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL if fault == "SIGKILL" else signal.SIGSTOP)
    return f"{role} {index}"


def pick(number: int, rng: random.Random, kinds: list[str]) -> dict:
    """Trial ``number``: the job's kind, the process, the moment, the fault, the restarts."""
    kind = rng.choice(kinds)
    chosen = [("worker", 0), ("worker", 1)]
    chosen += [("server", 0)] if kind != "collective" else []
    chosen += [("summer", 0)] if kind == "sync-3" else []
    role, index = rng.choice(chosen)
    fault = rng.choice(FAULTS)
    # a checkpoint is removed once there is one
    moment = rng.choice(MOMENTS[2:] if fault == "checkpoint removed" else MOMENTS)
    restarts = 0 if number % 4 == 1 else 2
    return dict(trial=number, kind=kind, role=role, index=index, moment=moment, fault=fault,
                restarts=restarts)  # fmt: skip


def run_trial(plan: dict, data: Path, top: Path, slurm) -> dict:
    """Start the job, inject the fault at its moment, wait for the end; what was seen."""
    folder = top / f"trial-{plan['trial']}"
    run_dir = folder / "run"
    job = start(plan["kind"], folder, data, plan["restarts"], slurm)
    seen = dict(hit=None, fault_at=None, again_at=None)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while job.poll() is None and time.monotonic() < deadline:
            if seen["fault_at"] is None and reached(plan["moment"], run_dir):
                seen["hit"] = inject(plan["fault"], plan["role"], plan["index"], run_dir)
                seen["fault_at"] = time.monotonic() if seen["hit"] else None
            elif seen["fault_at"] and seen["again_at"] is None:
                restarted = (run_dir / "logs" / "attempt-1").is_dir()
                if restarted and "resuming from" in text(run_dir / "logs" / "worker.0.log"):
                    seen["again_at"] = time.monotonic()  # set up again, its checkpoint loaded
            time.sleep(0.05)
        if job.poll() is None:
            job.kill()
        seen["stderr"] = job.communicate()[1]
        seen["ended_at"] = time.monotonic()
        seen["left"] = processes(run_dir)
        seen["returncode"] = job.returncode
        seen["statuses"] = run_statuses(folder / "mlflow.db")
        try:
            seen["weights"] = final_weights(run_dir)
        except FileNotFoundError:
            seen["weights"] = None
    finally:
        for pid in processes(run_dir):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
    return seen


def judge(plan: dict, seen: dict, refs: dict) -> dict:
    """The trial's record: what was done, what came of it, passed or not and why."""
    kind, fault = plan["kind"], plan["fault"]
    process = f"{plan['role']} {plan['index']}"
    record = dict(plan, process=process, hit=seen["hit"], passed=False, why="")
    fault_at = seen["fault_at"]
    record["seconds_to_training_again"] = (
        round(seen["again_at"] - fault_at, 1) if seen["again_at"] else None
    )
    record["seconds_fault_to_end"] = round(seen["ended_at"] - fault_at, 1) if fault_at else None
    errors = [line for line in seen["stderr"].splitlines() if line.startswith("kspipe: error:")]
    outcome = f"exit {seen['returncode']}, runs {seen['statuses']}, errors {errors[-1:]}"
    if seen["hit"] is None:
        record["why"] = "missed: the job had gone past the moment"
    elif seen["left"]:
        record["why"] = f"processes left: {seen['left']}"
    elif plan["restarts"] or fault == "checkpoint removed":
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
        limit = 30 + (STALL_S if fault == "SIGSTOP" else 0)
        record["passed"] = (
            seen["returncode"] != 0
            and len(errors) == 1
            and process in errors[0]
            and seen["statuses"] == ["FAILED"]
            and record["seconds_fault_to_end"] <= limit
        )
        record["why"] = "" if record["passed"] else outcome
    return record


def references(kinds: list[str], data: Path, top: Path, slurm) -> dict:
    """Per kind: the uninterrupted job's final parameters, and the largest difference
    between two uninterrupted runs (0 where the sum is exact: one run)."""
    refs = {}
    for kind in kinds:
        runs = []
        for n in range(1 if kind in EXACT else 2):
            folder = top / f"ref-{kind}-{n}"
            job = start(kind, folder, data, 0, slurm)
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


@contextlib.contextmanager
def scheduler(launcher: str, tmp: Path):
    """The local Slurm's environment for ``--launcher slurm``, else None."""
    if launcher != "slurm":
        yield None
        return
    from tests.kit.slurm import local_slurm, slurm_missing

    missing = slurm_missing()
    if missing:
        raise SystemExit(f"--launcher slurm: {missing}")
    with local_slurm(tmp / "slurm") as env:
        yield env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--launcher", choices=["processes", "slurm"], default="processes")
    parser.add_argument("--json", help="write every trial to this file")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: no kind {', '.join(unknown)} (there are {', '.join(KINDS)})")
    rng = random.Random(args.seed)
    records = []
    with tempfile.TemporaryDirectory(prefix="kspipe-faults-") as tmp:
        top = Path(tmp)
        with scheduler(args.launcher, top) as slurm:
            data = tiny_omniglot(top / "kanji")
            refs = references(kinds, data, top, slurm)
            for number in range(args.trials):
                plan = pick(number, rng, kinds)
                record = judge(plan, run_trial(plan, data, top, slurm), refs)
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
