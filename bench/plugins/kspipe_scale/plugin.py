"""The scaling bench's workload: one dense parameter ``w`` of ``scale.weights`` float32
values, trained by SGD on ``mean((w - x)^2)`` with ``x`` a number each worker draws a step.

A step's compute is small and fixed (a few passes over ``w``), plus ``scale.compute_ms`` of
sleep standing for a host's own compute, which one machine's cores cannot give every
emulated host; the exchange of ``w`` is the mode's own, as any workload's.  After
``scale.warmup`` steps and a barrier, each worker times ``scale.steps`` steps up to a
barrier after the last, and writes ``scale-worker<i>.json`` into its run folder: the
window (wall-clock seconds, comparable between the hosts of one machine), its steps, and,
from worker 0, a digest of the final ``w`` (sync must repeat it bit for bit).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from kspipe import hookimpl
from kspipe.contracts import Workload

NAME = "scale"


@dataclass
class ScaleConfig:
    """The ``scale`` group."""

    weights: int = 1_000_000
    steps: int = 5  # timed steps
    warmup: int = 2  # steps before the timed ones
    compute_ms: float = 0.0  # sleep a step: a host's own compute
    learning_rate: float = 0.1
    seed: int = 0
    chain: bool = True  # false: a collective job's sum through Paddle's gloo ops instead


@hookimpl
def kspipe_config_dirs():
    return ["pkg://kspipe_scale.conf"]


@hookimpl
def kspipe_config_schemas():
    return {NAME: ScaleConfig}


@hookimpl
def kspipe_describe_workload(cfg):
    return Workload(name=NAME, headline="round_s", rate="steps_per_s", summary=("round_s",))


@hookimpl
def kspipe_read_dataset(cfg, role):
    return None


@dataclass
class Programs:
    startup: object
    main: object
    loss: object


@hookimpl
def kspipe_build_program(cfg, dataset, role):
    import paddle

    c = cfg.scale
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = c.seed + 1
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        w = paddle.static.create_parameter(
            [c.weights], "float32", name="w", default_initializer=paddle.nn.initializer.Normal()
        )
        x = paddle.static.data("x", [1], "float32")
        loss = paddle.mean(paddle.square(w - x))
    return Programs(startup, main, loss)


@hookimpl
def kspipe_compile_program(cfg, role, programs):
    import paddle

    if not cfg.scale.chain:
        from kspipe.modes import fused

        fused.CHAIN_BYTES = -1  # no buffer is small enough for the chain: gloo's ops sum
    with (
        paddle.utils.unique_name.guard(),
        paddle.static.program_guard(programs.main, programs.startup),
    ):
        optimizer = paddle.optimizer.SGD(learning_rate=float(cfg.scale.learning_rate))
        role.distributed_optimizer(optimizer).minimize(programs.loss)
    return programs


@hookimpl
def kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter):
    c = cfg.scale
    index = role.worker_index()
    rng = np.random.default_rng([c.seed, index])
    executor.run(programs.startup, scope=scope)
    role.init_worker(scope)

    def step():
        executor.run(programs.main, scope=scope, feed={"x": rng.normal(size=1).astype("f4")})
        if c.compute_ms:
            time.sleep(c.compute_ms / 1000)

    for _ in range(c.warmup):
        step()
    role.barrier_worker()
    started = time.time()
    for done in range(c.steps):
        step()
        reporter.progress("train", done + 1, c.steps, {})
    role.barrier_worker()
    ended = time.time()
    window = {"index": index, "started": started, "ended": ended, "steps": c.steps}
    # where a parameter-server worker's exchange spent its time (the role's own record)
    for sync in getattr(role, "_syncs", []):
        window["exchange_s"] = {k: round(v, 3) for k, v in getattr(sync, "seconds", {}).items()}
    role.finish_training(scope)
    if role.is_first_worker():
        w = np.array(scope.find_var("w").get_tensor())
        window["digest"] = hashlib.sha256(w.tobytes()).hexdigest()[:16]
    with open(os.path.join(reporter.run_dir, f"scale-worker{index}.json"), "w") as out:
        json.dump(window, out)
    metrics = {"round_s": (ended - started) / c.steps}
    if role.is_first_worker():
        reporter.metrics(metrics, step=c.steps)
    return metrics


@hookimpl
def kspipe_save_inference_model(cfg, role, programs, executor, scope, dirname):
    return None  # the bench keeps no model
