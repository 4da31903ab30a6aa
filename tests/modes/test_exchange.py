"""The parameter servers' exchange, checked exactly on real clusters on 127.0.0.1.

* the arithmetic of each strategy (exchange_job.py: known changes, small integers,
  so every value is exact in float32), with one and two servers;
* Reptile with ``cluster.strategy=sync``: W workers end with the weights of one process
  whose meta-batch is the workers' tasks together (float rounding apart), with one and two
  servers.

The long learning runs, each mode against a local run over the same tasks, are in
workloads/test_learning.py.
"""

import json
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kspipe.cluster.plan import launch_plan
from kspipe.launchers.watcher import Cluster
from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager, tiny_overrides
from tests.kit import latest_weights, overloaded

JOB = Path(__file__).with_name("exchange_job.py")
START = {
    "shared": np.arange(4, dtype=np.float32),
    "own": np.zeros((2, 3), np.float32),
    "third": np.full(5, 7.0, np.float32),
}


def exchange_job(tmp_path, strategy, k_steps, rounds, servers, wait_push=True, beside=None):
    """Each worker's record; ``beside(plan)``, if given, runs while the job does."""
    out = tmp_path / "out"
    out.mkdir()
    cluster = Cluster(str(tmp_path), echo_first_worker=False)
    plan = launch_plan("pserver", 2, servers, threads=1)
    stop = threading.Event()
    visiting = threading.Thread(target=beside, args=(plan, stop), daemon=True) if beside else None
    try:
        for p in plan:
            cluster.start(
                p.role,
                p.index,
                p.env,
                [
                    sys.executable,
                    str(JOB),
                    strategy,
                    str(k_steps),
                    str(rounds),
                    str(out),
                    str(int(wait_push)),
                ],
            )
            if visiting is not None and p.role == "server":
                visiting.start()  # from the servers' start, through the workers' meeting
        cluster.wait(timeout_s=120)
    finally:
        stop.set()
        cluster.stop()
        if visiting is not None:
            visiting.join(30)
    return [json.loads((out / f"worker{w}.json").read_text()) for w in range(2)]


def servers_after(round_, k_steps, scale):
    """What the servers hold after ``round_`` rounds: each worker's changes times ``scale``."""
    steps = round_ * k_steps
    own = np.full((2, 3), steps * scale, np.float32)
    return {"shared": START["shared"] + steps * 3 * scale, "own": own, "third": START["third"]}


def assert_holds(actual: dict, expected: dict, what: str):
    for name, value in expected.items():
        np.testing.assert_array_equal(
            np.asarray(actual[name], np.float32), value, err_msg=f"{what}: {name}"
        )


@pytest.mark.parametrize(
    "strategy, k_steps, servers", [("sync", 1, 1), ("async", 1, 1), ("geo", 3, 2)]
)  # sync on 2 servers: the overloaded test
def test_strategy_arithmetic(tmp_path, strategy, k_steps, servers):
    rounds = 3
    records = exchange_job(tmp_path, strategy, k_steps, rounds, servers)
    check_arithmetic(records, strategy, k_steps, rounds)


def check_arithmetic(records, strategy, k_steps, rounds):
    """Every worker's record holds what the strategy's arithmetic says: worker 0's values
    after connecting, the servers' after each round, its own after each step and at the
    end."""
    scale = 1.0 if strategy == "async" else 0.5  # sync and geo send the change / workers
    for w, record in enumerate(records):
        assert_holds(record["connected"], START, f"worker {w} after connecting")  # worker 0's
        for r, servers_view in enumerate(record["servers"], 1):
            assert_holds(servers_view, servers_after(r, k_steps, scale), f"round {r}")
        for step, held in enumerate(record["held"], 1):
            r, into = divmod(step, k_steps)
            if strategy == "sync":  # every worker starts its next step from the servers'
                assert_holds(held, servers_after(r, 1, scale), f"worker {w} step {step}")
            elif into == 0:  # an exchange: the pull holds this worker's own push
                assert held["own"][w] == [r * k_steps * scale] * 3, (w, step, held)
            else:  # geo between exchanges: the local changes alone
                assert held["own"][w] == [r * k_steps * scale + into] * 3, (w, step, held)
        assert_holds(record["final"], servers_after(rounds, k_steps, scale), f"worker {w} final")


def strangers_at_the_book(plan, stop) -> None:
    """Until ``stop``: requests without the job's secret at the gloo meeting point (the bare
    keys gloo asks for, a guessed prefix, a huge value, garbage), as fast as it answers."""
    host, _, port = plan[0].env["PADDLE_GLOO_HTTP_ENDPOINT"].rpartition(":")
    requests = [
        b"PUT /_worker/1 HTTP/1.0\r\nContent-Length: 4\r\n\r\nfake",
        b"PUT /worker/0 HTTP/1.0\r\nContent-Length: 4\r\n\r\nfake",
        b"GET /" + b"0" * 32 + b"_worker/1 HTTP/1.0\r\n\r\n",
        b"PUT /_server/0 HTTP/1.0\r\nContent-Length: 1099511627776\r\n\r\n",
        b"\x00\xff garbage\r\n\r\n",
    ]
    while not stop.is_set():
        for request in requests:
            try:
                with socket.create_connection((host, int(port)), timeout=2) as stranger:
                    stranger.sendall(request)
                    stranger.recv(1024)
            except OSError:  # not listening yet, or gone
                time.sleep(0.01)


def test_strangers_at_the_meeting_point_change_nothing(tmp_path):
    """Strangers at server 0's gloo meeting point from the job's start to its end: the sync
    arithmetic is exact as without them, and server 0's log says it refused them."""
    rounds = 3
    records = exchange_job(tmp_path, "sync", 1, rounds, 1, beside=strangers_at_the_book)
    check_arithmetic(records, "sync", 1, rounds)
    log = (tmp_path / "logs" / "server.0.log").read_text()
    assert "kspipe: refused a connection to the gloo meeting point from 127.0.0.1:" in log
    assert "Traceback" not in log


def test_sync_loses_nothing_on_an_overloaded_machine(tmp_path):
    """40 sync rounds, two servers, 4 busy processes on the cores: every round and every
    step exact, as test_strategy_arithmetic checks them (this is its sync on 2 servers;
    ``wait_push``, which only async pushes read, is off)."""
    rounds = 40
    with overloaded(processes=4, seconds=240):
        records = exchange_job(tmp_path, "sync", 1, rounds, 2, wait_push=False)
    for record in records:
        assert len(record["servers"]) == rounds and len(record["held"]) == rounds
    check_arithmetic(records, "sync", 1, rounds)


def test_async_without_waiting_lags_one_push_at_most_and_loses_nothing(tmp_path):
    """Async steps that do not wait for their pushes, two servers, 4 busy processes on the
    cores (Paddle's client then queues up to 14 pushes): every value a worker goes on from
    holds all the worker's own pushes but at most the last (its pull, with its pushes
    that a part had not begun added back, and its held change), and after finish the
    servers hold every step's change, though changes made while a push was on its way
    went with the next push."""
    steps = 300  # as one "round" (async pushes every step): no barrier between steps
    with overloaded(processes=4, seconds=240):
        records = exchange_job(tmp_path, "async", steps, 1, 2, wait_push=False)
    for w, record in enumerate(records):
        for step, held in enumerate(record["held"], 1):
            assert set(held["own"][w]) <= {step - 1.0, float(step)}, (w, step, held)
        assert_holds(record["final"], servers_after(1, steps, 1.0), f"worker {w} final")
        assert record["pushes"] < steps * 0.9, record["pushes"]


def test_layout_puts_push_counts_first_in_every_part_a_server_applies():
    """Paddle's client gives server s the values [s * (size // S + 1), ...) of a dense
    table, and the server applies them in 10 parts (the first ones one longer): each
    part begins with the workers' counts, apart from every weight."""
    from kspipe.modes.ps.dense import SERVER_PARTS, Layout

    for weights, workers, servers in [
        (1, 1, 1),
        (3, 4, 2),
        (10, 2, 3),
        (112451, 8, 5),
        (0, 3, 7),
        (17, 1, 16),
        (1001, 2, 2),
    ]:
        layout = Layout({"a": [weights]}, workers, servers)
        per = layout.size // servers + 1
        for s in range(servers):
            length = min((s + 1) * per, layout.size) - s * per
            sizes = [
                length // SERVER_PARTS + (p < length % SERVER_PARTS) for p in range(SERVER_PARTS)
            ]
            for p in range(SERVER_PARTS):
                start = s * per + sum(sizes[:p])
                assert (
                    list(layout.counts[:, s * SERVER_PARTS + p])
                    == list(range(start, start + workers))
                    and sizes[p] >= workers
                )
        assert not set(layout.counts.ravel()) & set(layout.weights)
        assert len(set(layout.weights)) == weights
        flat = np.arange(layout.size, dtype=np.float32)
        values = layout.split(flat)["a"]
        np.testing.assert_array_equal(
            layout.split(layout.join({"a": values + 1}, flat))["a"], values + 1
        )


@pytest.fixture(scope="module")
def sync_common(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("sync")
    return [
        *tiny_overrides(tmp, tiny_data),
        "train.inner_optimizer=sgd",
        "train.inner_lr=0.05",
        "train.inner_iters=3",
        "train.checkpoint_every=0",
        "eval.baseline=false",
        "eval.interval=0",
        "tracking.enabled=false",
        "model.filters=8",
    ]


def reptile_run(tmp_path, common, name, *overrides):
    cfg = compose_config(
        ["+experiment=omniglot_5way", *common, f"run_dir={tmp_path / name}", *overrides]
    )
    metrics = run(cfg, plugin_manager())
    return metrics, latest_weights(tmp_path / name)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, sync_common):
    """One process, 3 meta-iterations of 4 tasks: the reference of 2 workers x 2 tasks."""
    tmp = tmp_path_factory.mktemp("one")
    _, weights = reptile_run(tmp, sync_common, "local", "train.meta_batch=4", "train.meta_iters=3")
    return weights


@pytest.fixture(scope="module")
def alone(tmp_path_factory, sync_common):
    """One process, 3 meta-iterations of 2 tasks: a worker's own tasks alone."""
    tmp = tmp_path_factory.mktemp("alone")
    _, weights = reptile_run(tmp, sync_common, "alone", "train.meta_batch=2", "train.meta_iters=3")
    return weights


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_reptile_equals_one_process_over_the_workers_tasks(
    tmp_path, sync_common, one_process, alone, servers
):
    metrics, cluster = reptile_run(
        tmp_path,
        sync_common,
        "cluster",
        "train.meta_batch=2",
        "train.meta_iters=6",
        "mode=pserver",
        "workers=2",
        f"servers={servers}",
        "cluster.strategy=sync",
        "cluster.timeout_s=300",
    )
    for name, value in one_process.items():
        if not name.endswith((".mean", ".var")):  # batch norm's running statistics stay local
            np.testing.assert_allclose(cluster[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # each worker's 2 tasks alone would end elsewhere: the comparison can tell
    assert (
        max(np.abs(alone[n] - one_process[n]).max() for n in one_process if n.startswith("conv"))
        > 1e-3
    )
    assert metrics["tasks_per_s"] > 0 and metrics["worker1/tasks_per_s"] > 0


def test_sync_with_shard_summers_equals_the_chain_alone(tmp_path, sync_common):
    """3 workers, 2 servers: a fifth of each round's sum along the workers' chain, the rest
    on a summer beside each server (their logs say which values), against the same job
    with the chain alone: the same parameters, bit for bit.  (Three workers' float32
    changes add exactly in float64 in any order: the order of addition is
    test_sharded_sum.py's to check; this checks each value's sum and its way back.)"""
    common = [
        *sync_common,
        "train.meta_batch=2",
        "train.meta_iters=3",
        "mode=pserver",
        "workers=3",
        "servers=2",
        "cluster.strategy=sync",
        "cluster.timeout_s=300",
    ]
    _, sharded = reptile_run(tmp_path, common, "sharded")
    _, chain = reptile_run(tmp_path, common, "chain", "cluster.shard_sum=false")
    assert sharded.keys() == chain.keys()
    for name, value in chain.items():
        np.testing.assert_array_equal(sharded[name], value, err_msg=name)
    for s in (0, 1):
        said = (tmp_path / "sharded" / "logs" / f"server.{s}.log").read_text()
        assert f"server {s}: its shard summer sums values [" in said
        assert "shard summer" not in (tmp_path / "chain" / "logs" / f"server.{s}.log").read_text()
