"""Whole-process speed of the default Reptile job: a bare Paddle loop shaped like the
reference implementation, kspipe one task at a time, and kspipe with tasks side by side.

    python bench/bench_speed.py                       # 300 meta-iterations + 300 test tasks, twice
    python bench/bench_speed.py --meta-iters 1500 --repeats 1

Each job is one process, timed from its start to its end (imports, data, programs,
training, evaluation), doing the same work: ``+experiment=omniglot_5way``'s training
(meta-batch 5, 5 Adam steps of batch 10 per task) for ``--meta-iters`` meta-iterations,
then ``--test-tasks`` test tasks of 50 steps at batch 5 and 1 training task; no baseline,
no learning curve.  All three see the same tasks of the embedded KanjiVG data set (they
share kspipe's sampling and seeds) and run the same model with the same kernels (oneDNN
convolutions).  Nothing is fetched.

The bare loop follows openai/supervised-reptile's structure: one executor call per inner
step, the model's weights saved and restored through numpy around each task, the meta
step in numpy, the whole state saved and restored around each test task.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np  # noqa: E402

EXPERIMENT = "+experiment=omniglot_5way"
#: When the parent started this child process (``time.time()``); a child started some other
#: way counts from its own start.
STARTED = float(os.environ.get("BENCH_STARTED", time.time()))
KSPIPE_JOBS = {
    "kspipe, one task at a time": ["train.batch_tasks=false", "eval.batch_tasks=1"],
    "kspipe, tasks side by side": [],
}
JOB_KEYS = {
    "bare": "bare Paddle loop, reference's structure",
    "before": "kspipe, one task at a time",
    "after": "kspipe, tasks side by side",
}


def job_overrides(args) -> list[str]:
    return [
        EXPERIMENT,
        f"train.meta_iters={args.meta_iters}",
        f"eval.tasks={args.test_tasks}",
        "eval.train_tasks=1",
        "eval.baseline=false",
        "eval.interval=0",
        "train.checkpoint_every=0",
    ]


def report(**values) -> None:
    """The child's last line: its figures and its peak resident memory."""
    values["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("BENCH " + json.dumps(values), flush=True)


# --- the bare loop ------------------------------------------------------------------


def reference_job(args) -> None:
    """The reference's structure in a bare Paddle loop, on kspipe's model and tasks."""
    import paddle

    from kspipe.compiling import use_onednn
    from kspipe.fewshot import plugin as fewshot
    from kspipe.fewshot.data import sample_task
    from kspipe.modes.role import Role
    from kspipe.reptile.programs import build_programs, inner_batches, meta_step_size
    from kspipe.reptile.tasks import EVAL_TEST_STREAM, EVAL_TRAIN_STREAM, TRAIN_STREAM, nchw
    from kspipe.testing import compose_config

    cfg = compose_config(job_overrides(args))
    dataset = fewshot.kspipe_read_dataset(cfg=cfg, role=Role())
    p = build_programs(dataset.image_shape, cfg.task.ways, cfg.model, cfg.train.inner_lr, cfg.seed)
    use_onednn(p.train, p.forward)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(p.startup, scope=scope)
    place = paddle.CPUPlace()

    def export(names):
        return [np.array(scope.find_var(n).get_tensor()) for n in names]

    def load(names, values):
        for n, v in zip(names, values):
            scope.find_var(n).get_tensor().set(v, place)

    def step(x, y):
        exe.run(p.train, feed={"x": x, "y": y.reshape(-1, 1)}, scope=scope)

    startup = time.time() - STARTED
    train, began = cfg.train, time.perf_counter()
    for i in range(train.meta_iters):
        theta, adapted = export(p.params), []
        for j in range(train.meta_batch):
            rng = np.random.default_rng([cfg.seed, TRAIN_STREAM, i * train.meta_batch + j])
            t = sample_task(dataset.train, cfg.task.ways, train.shots, 0, rng)
            x = nchw(t.support_x)
            load(p.params, theta)
            for idx in inner_batches(len(x), train.inner_batch, train.inner_iters, rng):
                step(x[idx], t.support_y[idx])
            adapted.append(export(p.params))
        eps = meta_step_size(i, train.meta_iters, train.meta_step, train.meta_step_final)
        load(
            p.params,
            [old + eps * (np.mean(new, axis=0) - old) for old, *new in zip(theta, *adapted)],
        )
    trained = time.perf_counter() - began

    def evaluate(classes, tasks, stream):
        state, accuracies = export(p.state), []
        for k in range(tasks):
            rng = np.random.default_rng([cfg.seed, stream, k])
            t = sample_task(classes, cfg.task.ways, cfg.task.shots, cfg.eval.queries, rng)
            x = nchw(t.support_x)
            load(p.state, state)
            for idx in inner_batches(len(x), cfg.eval.inner_batch, cfg.eval.inner_iters, rng):
                step(x[idx], t.support_y[idx])
            (logits,) = exe.run(
                p.forward, feed={"x": nchw(t.query_x)}, fetch_list=[p.logits], scope=scope
            )
            accuracies.append(np.mean(np.asarray(logits).argmax(axis=1) == t.query_y))
        load(p.state, state)
        acc = np.array(accuracies)
        return float(acc.mean()), float(1.96 * acc.std(ddof=1) / np.sqrt(len(acc)))

    began = time.perf_counter()
    accuracy, ci = evaluate(dataset.test, cfg.eval.tasks, EVAL_TEST_STREAM)
    evaluate(dataset.train, cfg.eval.train_tasks, EVAL_TRAIN_STREAM)
    evaluated = time.perf_counter()
    report(
        startup_s=startup,
        train_s=trained,
        eval_s=evaluated - began,
        test_accuracy=accuracy,
        test_accuracy_ci95=ci,
    )


# --- kspipe -------------------------------------------------------------------------


class Stamped(io.TextIOBase):
    """The standard error that also keeps each line written to it with the time it came
    (kspipe's progress lines: the phases' ends)."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        now = time.time()
        self.lines += [(now, line) for line in text.splitlines() if line.strip()]
        return sys.__stderr__.write(text)

    def isatty(self) -> bool:
        return False

    def at(self, prefix: str) -> list[float]:
        """When each line that begins with ``prefix`` came."""
        times = [at for at, line in self.lines if line.startswith(prefix)]
        if not times:
            raise SystemExit(f"the job printed no line that begins with {prefix!r}")
        return times


def kspipe_job(overrides: list[str]) -> None:
    """``kspipe <overrides>`` in this process, then its figures from the closing line and
    its phases from the times of its progress lines: start-up to the first meta-iteration's
    line, training to the last one's, evaluation to the last evaluation's (the parent
    counts the rest, to the process's exit, as its end)."""
    import contextlib

    from kspipe.cli import command as cli

    sys.argv = ["kspipe", *overrides]
    out, progress = io.StringIO(), Stamped()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(progress):
        cli.main()
    line = [s for s in out.getvalue().splitlines() if s.startswith("kspipe: done")][-1]
    acc, ci = re.search(r"test_accuracy ([\d.]+) ± ([\d.]+)", line).groups()
    rate = float(re.search(r"tasks_per_s ([\d.]+)", line).group(1))
    first, trained = progress.at("meta-train")[0], progress.at("meta-train")[-1]
    evaluated = progress.at("evaluate")[-1]
    report(
        test_accuracy=float(acc),
        test_accuracy_ci95=float(ci),
        tasks_per_s=rate,
        startup_s=first - STARTED,
        train_s=trained - first,
        eval_s=evaluated - trained,
    )


# --- the parent ---------------------------------------------------------------------


def child(argv: list[str], cwd: str, env: dict = None) -> tuple[float, dict]:
    start = time.perf_counter()
    env = {**os.environ, **(env or {}), "BENCH_STARTED": repr(time.time())}
    result = subprocess.run(
        [sys.executable, __file__, *argv], cwd=cwd, capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - start
    lines = [s for s in result.stdout.splitlines() if s.startswith("BENCH ")]
    if result.returncode or not lines:
        raise SystemExit(f"{argv[0]} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return wall, json.loads(lines[-1][len("BENCH ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta-iters", type=int, default=300)
    parser.add_argument("--test-tasks", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-steps", action="store_true", help="skip the inner-step times")
    parser.add_argument(
        "--jobs",
        default="bare,before,after",
        help="which jobs, of bare, before and after (the bare loop comes first)",
    )
    parser.add_argument("--child", choices=("reference", "kspipe", "steps"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "reference":
        return reference_job(args)
    if args.child == "kspipe":
        return kspipe_job(args.overrides)
    if args.child == "steps":
        from speed_steps import step_times  # bench/, the script's own folder

        return report(**step_times(int(args.overrides[0])))

    import paddle

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, Paddle {paddle.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f}"
    )
    tasks = args.meta_iters * 5
    print(
        f"work: {args.meta_iters} meta-iterations ({tasks} tasks), then "
        f"{args.test_tasks} test tasks of 50 steps"
    )
    if not args.no_steps:
        for threads in (1, 2):
            _, times = child(
                ["--child", "steps", str(threads)], os.getcwd(), {"OMP_NUM_THREADS": str(threads)}
            )
            times.pop("peak_mib")
            print(
                f"OMP_NUM_THREADS={threads}: "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()),
                flush=True,
            )
    size = ["--meta-iters", str(args.meta_iters), "--test-tasks", str(args.test_tasks)]
    jobs = {"bare Paddle loop, reference's structure": ["--child", "reference", *size]}
    for name, extra in KSPIPE_JOBS.items():
        jobs[name] = ["--child", "kspipe", "--", *job_overrides(args), *extra]
    chosen = {JOB_KEYS[key] for key in args.jobs.split(",")} | {JOB_KEYS["bare"]}
    jobs = {name: argv for name, argv in jobs.items() if name in chosen}
    phases = {name: [] for name in jobs}
    for repeat in range(args.repeats):
        for name, argv in jobs.items():
            with tempfile.TemporaryDirectory() as folder:
                wall, figures = child(argv, folder)
            figures["whole_s"] = wall
            figures["end_s"] = (
                wall - figures["startup_s"] - figures["train_s"] - figures["eval_s"]
            )  # from the evaluation's end to the process's exit
            phases[name].append(figures)
            print(
                f"[{repeat + 1}] {name}: {wall:.1f} s whole process "
                f"({(tasks + args.test_tasks) / wall:.2f} tasks/s): start-up "
                f"{figures['startup_s']:.1f} s, training {figures['train_s']:.1f} s "
                f"({tasks / figures['train_s']:.1f} tasks/s), evaluation "
                f"{figures['eval_s']:.1f} s, end {figures['end_s']:.1f} s; test accuracy "
                f"{figures['test_accuracy']:.3f} ± {figures['test_accuracy_ci95']:.3f}, peak "
                f"{figures['peak_mib']:.0f} MiB, load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    bare = best(phases[next(iter(jobs))])
    for name, runs in phases.items():
        mine = best(runs)
        print(
            f"{name}: best of each phase: "
            + ", ".join(
                f"{label} {mine[phase]:.1f} s ({bare[phase] / mine[phase]:.2f}x the bare loop)"
                for phase, label in PHASES.items()
            )
        )


PHASES = {
    "whole_s": "whole",
    "startup_s": "start-up",
    "train_s": "training",
    "eval_s": "evaluation",
}


def best(runs: list[dict]) -> dict:
    """Each phase's shortest time over ``runs``."""
    return {phase: min(run[phase] for run in runs) for phase in PHASES}


if __name__ == "__main__":
    sys.exit(main())
