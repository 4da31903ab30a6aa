"""One process of bench/bench_exchange.py's job: ``steps`` exchange steps of one strategy.

    python exchange_steps.py <strategy> <parameters> <steps> <out folder>

Each worker changes every parameter a little before each step (as a local update would) and
times the steps; worker 0 writes ``worker0.json``: the mean step and its parts, in seconds.
"""

import json
import os
import sys
import time

import numpy as np

from kspipe.modes.ps.exchange import StrategyExchange
from kspipe.modes.pserver import PserverRole
from kspipe.modes.role import read_vars, write_vars


class Quiet:
    def say(self, message):
        pass


def main(strategy: str, params: int, steps: int, out: str) -> None:
    import paddle

    shapes = {"theta": [params]}
    role = PserverRole(dict(strategy=strategy))
    if role.is_server():  # its table, and its shard summer if the rounds use one
        sync = StrategyExchange(role, shapes, strategy, k_steps=1)
        role.run_server(Quiet())
        return
    scope = paddle.static.Scope()
    write_vars(scope, {"theta": np.zeros(params, np.float32)})
    sync = StrategyExchange(role, shapes, strategy, k_steps=1)
    sync.connect(scope)
    role.barrier_worker()
    started = time.perf_counter()
    for _ in range(steps):
        values = read_vars(scope, shapes)
        values["theta"] += 0.001
        write_vars(scope, values)
        sync.step(scope)
    seconds = time.perf_counter() - started
    sync.finish(scope)
    if role.worker_index() == 0:
        with open(os.path.join(out, "worker0.json"), "w") as f:
            json.dump(
                {"step": seconds / steps, "parts": {k: v / steps for k, v in sync.seconds.items()}},
                f,
            )
    sync.close(clean=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
