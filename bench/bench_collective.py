"""The collective mode on CPU: where a step's time goes, and the classifier against one process.

    python bench/bench_collective.py [--steps 600] [--skip-parts] [--skip-workload]
                                     [--epochs 8] [--repeats 3] [--before DIR]

1. A step's parts on 2 workers (gloo on 127.0.0.1): the classifier plugin's model (8
   features, 32 hidden, 4 classes: 420 weights in 4 tensors), 32 samples a worker, the
   loss fetched, timed as one program run on Paddle's executor as kspipe sets it
   (:mod:`kspipe.process.memory`; ms, median of alternated rounds, worker 0's view): with no
   exchange; with one all-reduce and one scale per gradient (the mode's
   programs before their gradients were fused); with the fused exchange as the mode now
   made it before (one all-gather of a buffer this small); with the fused buffer through
   gloo's ring all-reduce; and summed along the workers' chain of kspipe's own sockets in a
   ``py_func`` op, as the mode now makes it.  The difference to "no exchange" is what the
   exchange costs a step.
2. The example classifier plugin (plugins/kspipe-classifier, installed into a temporary
   folder) trained with ``kspipe +experiment=blobs`` at batch 64, as bench_exchange.py
   trains it: ``mode=local`` and ``mode=collective workers=2``, and with ``--before DIR``
   ``mode=collective workers=2`` run on the kspipe in DIR (a copy of another revision, put
   first on ``PYTHONPATH``); the jobs alternated ``--repeats`` times over, each job's median
   samples/s against local's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from bench_exchange import classifier_runs, print_rates  # noqa: E402

VARIANTS = (
    "no exchange",
    "per gradient",
    "fused (all-gather)",
    "fused (ring)",
    "fused (chain)",
)


def build(variant: str, role):
    """The classifier's training program with ``variant``'s exchange; (main, startup, loss)."""
    import paddle

    from kspipe.modes import fused
    from kspipe.modes.collective import GradientAllReduce

    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 1
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [None, 8], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        hidden = paddle.static.nn.fc(x, 32, activation="relu")
        loss = paddle.nn.functional.cross_entropy(paddle.static.nn.fc(hidden, 4), y)
        optimizer = paddle.optimizer.SGD(learning_rate=0.1)
        if variant == "no exchange":
            optimizer.minimize(loss)
        elif variant == "per gradient":
            params_grads = optimizer.backward(loss)
            for _, grad in params_grads:
                main.global_block().append_op(
                    type="c_allreduce_sum",
                    inputs={"X": [grad]},
                    outputs={"Out": [grad]},
                    attrs={"ring_id": 0, "use_calc_stream": True},
                )
                fused.append_scale(main.global_block(), grad, 1.0 / role.nranks)
            optimizer.apply_gradients(params_grads)
        else:
            fused.GATHER_BYTES = 0 if variant == "fused (ring)" else 64 * 1024
            fused.CHAIN_BYTES = 1 << 40 if variant == "fused (chain)" else -1
            GradientAllReduce(role, optimizer).minimize(loss)
    return main, startup, loss


def step_parts_worker(steps: int) -> None:
    """One of the two workers of part 1 (started with Paddle's environment by part 1)."""
    import numpy as np
    import paddle

    from kspipe.modes.collective import CollectiveRole

    paddle.enable_static()
    role = CollectiveRole()
    role.init_worker(paddle.static.Scope())  # the chain of sockets made
    rng = np.random.default_rng(role.rank)
    feed = {
        "x": rng.normal(size=(32, 8)).astype(np.float32),
        "y": rng.integers(0, 4, (32, 1)).astype(np.int64),
    }
    exe = paddle.static.Executor(paddle.CPUPlace())
    programs = {}
    for variant in VARIANTS:
        main, startup, loss = build(variant, role)
        scope = paddle.static.Scope()
        exe.run(startup, scope=scope)
        for _ in range(50):  # warm-up
            exe.run(main, scope=scope, feed=feed, fetch_list=[loss])
        programs[variant] = (main, scope, loss)
    times = {v: [] for v in VARIANTS}
    for _ in range(5):
        for variant, (main, scope, loss) in programs.items():
            role.barrier_worker()
            started = time.perf_counter()
            for _ in range(steps // 5):
                exe.run(main, scope=scope, feed=feed, fetch_list=[loss])
            times[variant].append((time.perf_counter() - started) / (steps // 5))
    if role.rank == 0:
        print(json.dumps({v: statistics.median(t) for v, t in times.items()}))


def step_parts(steps: int) -> dict:
    from kspipe.cluster.plan import launch_plan
    from kspipe.process.memory import EXECUTOR_DEFAULTS

    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(steps)],
            env={**EXECUTOR_DEFAULTS, **os.environ, **p.env},  # Paddle's executor as in a job
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in launch_plan("collective", 2, threads=1)
    ]
    out = [w.communicate()[0] for w in workers]
    if any(w.returncode for w in workers):
        raise SystemExit("a worker of the step bench failed")
    return json.loads(out[0].strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return step_parts_worker(int(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="steps of each variant (part 1)")
    parser.add_argument("--skip-parts", action="store_true")
    parser.add_argument("--skip-workload", action="store_true")
    parser.add_argument("--epochs", type=int, default=8, help="the classifier's epochs")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each job, alternated")
    parser.add_argument("--before", help="a kspipe tree to run the collective job on too")
    args = parser.parse_args()
    if not args.skip_parts:
        print("a classifier step on 2 collective workers, 32 samples each (ms, worker 0)")
        parts = step_parts(args.steps)
        for variant, seconds in parts.items():
            extra = seconds - parts["no exchange"]
            print(f"  {variant:<20} {seconds * 1e3:6.3f}  (exchange {extra * 1e3:6.3f})")
    if args.skip_workload:
        return
    jobs = {"local": ([], None), "collective": (["mode=collective", "workers=2"], None)}
    if args.before:
        before = str(Path(args.before).resolve())
        jobs["collective (before)"] = (["mode=collective", "workers=2"], before)
    print(
        f"classifier plugin (+experiment=blobs), batch 64, 16,384 points, {args.epochs} "
        f"epochs, {args.repeats} runs of each job, alternated"
    )
    with tempfile.TemporaryDirectory() as tmp:
        runs = classifier_runs(Path(tmp), args.epochs, args.repeats, jobs)
    print_rates(runs, width=20)


if __name__ == "__main__":
    main()
