"""One process of a parameter-server job that checks the strategy exchange's arithmetic
(run by test_exchange.py through kspipe's launcher, with Paddle's environment set).

    python exchange_job.py <strategy> <k_steps> <rounds> <out folder> [<wait_push 0|1>]

Worker w adds w + 1 to every element of ``shared`` and 1 to its own row of ``own`` at each
step, then steps the exchange; it records what it holds after each step and, after a
barrier of all workers, what the servers hold (``*.json`` in the out folder).
"""

import json
import os
import sys

import numpy as np

from kspipe.modes.ps.exchange import StrategyExchange
from kspipe.modes.pserver import PserverRole
from kspipe.modes.role import read_vars, write_vars
from kspipe.testing import QuietReporter

SHAPES = {"shared": [4], "own": [2, 3], "third": [5]}  # several tables to spread
START = {
    "shared": np.arange(4, dtype=np.float32),
    "own": np.zeros((2, 3), np.float32),
    "third": np.full(5, 7.0, np.float32),
}


def main(strategy: str, k_steps: int, rounds: int, out: str, wait_push: bool = True) -> None:
    import paddle

    role = PserverRole(dict(strategy=strategy, k_steps=k_steps, wait_push=wait_push))
    if role.is_server():  # its table, and its shard summer if the rounds use one
        sync = StrategyExchange(role, SHAPES, strategy, k_steps, wait_push=wait_push)
        role.run_server(QuietReporter())
        return
    w = role.worker_index()
    scope = paddle.static.Scope()
    write_vars(scope, START if w == 0 else {n: v + 100 for n, v in START.items()})
    sync = StrategyExchange(role, SHAPES, strategy, k_steps, wait_push=wait_push)
    sync.connect(scope)
    record = {"connected": as_lists(read_vars(scope, SHAPES)), "held": [], "servers": []}
    for step in range(rounds * k_steps):
        values = read_vars(scope, SHAPES)
        values["shared"] += w + 1
        values["own"][w] += 1
        write_vars(scope, values)
        sync.step(scope)
        record["held"].append(as_lists(read_vars(scope, SHAPES)))
        if (step + 1) % k_steps == 0:  # a round: every worker exchanged; what do servers hold?
            sync.write_back()  # the first worker writes it to the servers when read
            role.barrier_worker()
            servers = sync.exchange.pull()
            record["servers"].append(as_lists(servers))
            write_vars(scope, servers)  # go on from them, as the exchange's next pull would
            role.barrier_worker()  # nobody pushes round r + 1 before all have looked
    sync.finish(scope)
    record["final"] = as_lists(read_vars(scope, SHAPES))
    record["pushes"] = sync.pushed
    with open(os.path.join(out, f"worker{w}.json"), "w") as f:
        json.dump(record, f)
    sync.close(clean=True)


def as_lists(values: dict) -> dict:
    return {name: np.asarray(v).tolist() for name, v in values.items()}


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        len(sys.argv) < 6 or sys.argv[5] == "1",
    )
