"""One worker of a collective job that trains a small model two ways and records both (run
by test_collective.py through kspipe's launcher, with Paddle's environment set).

    python collective_job.py <out folder> <steps> <gather_bytes>

The same model, from the same start, on this worker's own batches: once with each
gradient all-reduced and scaled on its own (the collective mode's programs before their
gradients were fused, written out here), once through the mode's optimiser
(:class:`GradientAllReduce`, one fused exchange; ``gather_bytes`` sets
:data:`kspipe.modes.fused.GATHER_BYTES`, 0 for gloo's ring, -1 for the workers' chain of
sockets, the mode's default).  It records each step's mean
gradients and the final parameters of both, and the parameters' average both ways
(:func:`reduce_program` per variable and fused), as ``worker<rank>.npz`` in the out folder.
"""

import sys

import numpy as np

from kspipe.modes import fused
from kspipe.modes.collective import CollectiveRole, GradientAllReduce, reduce_program
from kspipe.modes.role import read_vars, write_vars


def build(role, optimiser):
    """The model, its parameters and gradients; ``optimiser`` makes the distributed one."""
    import paddle

    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [None, 8], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        hidden = paddle.static.nn.fc(x, 24, activation="tanh")
        hidden = paddle.static.nn.fc(hidden, 16, activation="relu")
        logits = paddle.static.nn.fc(hidden, 5)
        loss = paddle.nn.functional.cross_entropy(logits, y)
        params_grads = optimiser(role, paddle.optimizer.SGD(learning_rate=0.3), loss)
    return main, startup, params_grads


def per_gradient(role, optimizer, loss):
    """Each gradient all-reduced, then scaled by 1/workers, on its own."""
    params_grads = optimizer.backward(loss)
    block = loss.block
    for _, grad in params_grads:
        block.append_op(
            type="c_allreduce_sum",
            inputs={"X": [grad]},
            outputs={"Out": [grad]},
            attrs={"ring_id": 0, "use_calc_stream": True},
        )
        fused.append_scale(block, grad, 1.0 / role.nranks)
    optimizer.apply_gradients(params_grads)
    return params_grads


def fused_gradients(role, optimizer, loss):
    _, params_grads = GradientAllReduce(role, optimizer).minimize(loss)
    return params_grads


def train(role, optimiser, steps):
    import paddle

    main, startup, params_grads = build(role, optimiser)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(startup, scope=scope)
    rng = np.random.default_rng(role.rank)
    grads = []
    for _ in range(steps):
        feed = {
            "x": rng.normal(size=(6, 8)).astype(np.float32),
            "y": rng.integers(0, 5, (6, 1)).astype(np.int64),
        }
        grads.append(exe.run(main, scope=scope, feed=feed, fetch_list=[g for _, g in params_grads]))
    params = read_vars(scope, [p.name for p, _ in params_grads])
    return grads, params


def averaged(role, values, **fuse):
    import paddle

    variables = {name: (list(v.shape), "float32") for name, v in values.items()}
    scope = paddle.static.Scope()
    write_vars(scope, values)
    role.run_collective(reduce_program(variables, scale=1.0 / role.nranks, **fuse), scope)
    return read_vars(scope, list(values))


def main(out: str, steps: int, gather_bytes: int) -> None:
    import paddle

    paddle.enable_static()
    fused.GATHER_BYTES = max(gather_bytes, 0)
    fused.CHAIN_BYTES = fused.CHAIN_BYTES if gather_bytes < 0 else -1
    role = CollectiveRole()  # no init_worker: the chain is made at the first sum
    record = {}
    for name, optimiser in (("each", per_gradient), ("fused", fused_gradients)):
        grads, params = train(role, optimiser, steps)
        for step, values in enumerate(grads):
            for i, value in enumerate(values):
                record[f"{name}/grad{step}.{i}"] = value
        for key, value in params.items():
            record[f"{name}/param/{key}"] = value
    own = {k.split("/")[-1]: v for k, v in record.items() if k.startswith("fused/param/")}
    own = {k: v * np.float32(role.rank + 1) for k, v in own.items()}  # unequal on each
    for name, fuse in (("each", {}), ("fused", {"nranks": role.nranks})):
        for key, value in averaged(role, own, **fuse).items():
            record[f"{name}/average/{key}"] = value
    np.savez(f"{out}/worker{role.rank}.npz", **record)
    role.barrier_worker()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
