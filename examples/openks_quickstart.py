"""An OpenKS-style training script: a small MLP on generated data, written against the
seed's API.  It runs unchanged in one process and on local clusters:

    python examples/openks_quickstart.py --out /tmp/qs
    kspipe-launch --mode cpu --worker_num 2 --server_num 1 \
        examples/openks_quickstart.py --out /tmp/qs
    kspipe-launch --mode gpu --worker_num 2 examples/openks_quickstart.py --flag 1 --out /tmp/qs
"""

import argparse

import numpy as np
import paddle

from kspipe.openks import (
    AsyncStrategy,
    CollectiveStrategy,
    GeoStrategy,
    KSDistributedFactory,
    PaddleCloudRoleMaker,
    SyncStrategy,
)

STRATEGIES = {
    "async": AsyncStrategy(),
    "sync": SyncStrategy(),
    "geo": GeoStrategy(k_steps=4),
    "allreduce": CollectiveStrategy(),
    "local_sgd": CollectiveStrategy("local_sgd", 4),
}


def make_data(rng, n, truth):
    x = rng.normal(size=(n, 16)).astype("float32")
    y = (x @ truth > 0).astype("int64").reshape(-1, 1)
    return x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--flag", type=int, default=0)
    parser.add_argument("--strategy", default="async")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    paddle.enable_static()
    paddle.seed(1)
    x = paddle.static.data("x", [None, 16], "float32")
    y = paddle.static.data("y", [None, 1], "int64")
    hidden = paddle.static.nn.fc(x, 32, activation="relu")
    logits = paddle.static.nn.fc(hidden, 2)
    loss = paddle.nn.functional.cross_entropy(logits, y)

    algorithm = KSDistributedFactory.instantiation(flag=args.flag)
    algorithm.init(PaddleCloudRoleMaker(is_collective=args.flag == 1))
    optimizer = algorithm.distributed_optimizer(
        paddle.optimizer.SGD(0.1), STRATEGIES[args.strategy]
    )
    optimizer.minimize(loss)

    if algorithm.is_server():
        algorithm.init_server()
        algorithm.run_server()
        return
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    algorithm.init_worker()
    truth = np.random.default_rng(0).normal(size=16)
    rng = np.random.default_rng(100 + algorithm.worker_index())
    for _ in range(args.steps):
        bx, by = make_data(rng, 32, truth)
        (value,) = exe.run(
            paddle.static.default_main_program(), feed={"x": bx, "y": by}, fetch_list=[loss]
        )
    test_x, test_y = make_data(np.random.default_rng(7), 500, truth)
    algorithm.barrier_workers()
    (out,) = exe.run(
        paddle.static.default_main_program().clone(for_test=True),
        feed={"x": test_x, "y": test_y},
        fetch_list=[logits],
    )
    accuracy = float(np.mean(out.argmax(axis=1) == test_y.ravel()))
    print(
        f"worker {algorithm.worker_index()} of {algorithm.worker_num()}: "
        f"final loss {float(np.mean(value)):.3f} accuracy {accuracy:.3f}",
        flush=True,
    )
    if algorithm.is_first_worker():
        algorithm.save_inference_model(exe, args.out, ["x"], [logits])
    algorithm.stop_worker()


if __name__ == "__main__":
    main()
