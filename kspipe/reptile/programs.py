"""Reptile's models and programs in Paddle's static graph.

Reptile (Nichol, Achiam and Schulman, 2018) meta-learns an initialisation theta:
for each task of a meta-batch it adapts a copy phi of theta with a few Adam steps
(beta1 = 0) on the task's images, then moves theta towards the mean of the adapted
phi's: ``theta <- theta + eps * (mean(phi) - theta)``, with eps annealed linearly.

Everything stays inside the Paddle scope: small programs copy parameters to their
backup variables and back, accumulate the adapted weights and apply the meta step,
so no weights go through numpy between tasks.  Adam's moments carry over from task
to task, as in the paper's code; evaluation restores the whole state afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

THETA = "@THETA"  # suffix of the meta-parameters' backup variables
ACC = "@ACC"  # suffix of the accumulated adapted weights
SNAP = "@SNAP"  # suffix of the whole-state snapshot used around evaluation


@dataclass
class ReptilePrograms:
    """The programs of one Reptile model, all over the same variables."""

    startup: object
    train: object  # one Adam step on a batch: feeds x, y; fetches loss
    forward: object  # logits of a batch (batch statistics), no update
    infer: object  # the same forward with batch norm spelt out, for export
    save_theta: object  # theta <- params
    restore_theta: object  # params <- theta
    accumulate: object  # acc <- acc + params
    unaccumulate: object  # acc <- acc - params (FOML: the change of the last inner step)
    meta_update: object  # theta <- a*theta + b*acc; params <- theta; acc <- 0 (feeds a, b)
    snapshot: object  # whole training state -> its snapshot
    restore_snapshot: object  # snapshot -> whole training state
    x: object
    y: object
    loss: object
    logits: object
    infer_x: object
    infer_logits: object
    params: list = field(default_factory=list)  # trainable parameter names
    state: list = field(default_factory=list)  # every persistable of the train program
    decay: object = None  # params <- params * train.weight_decay, before each inner step
    compiled_train: object = None  # set by the compile stage; runs like ``train``
    sync: object = None  # set by the compile stage: the mode's exchange of ``params``
    batched: dict = field(default_factory=dict)  # T -> BatchedPrograms of T tasks side by side
    later: dict = field(default_factory=dict)  # T -> a maker of those only evaluation uses

    @property
    def train_program(self):
        return self.compiled_train if self.compiled_train is not None else self.train


INNER_OPTIMIZERS = ("adam", "sgd")
ALGORITHMS = ("reptile", "foml")


def build_programs(
    image_shape,
    ways: int,
    model,
    inner_lr: float,
    seed: int,
    inner_optimizer: str = "adam",
    weight_decay: float = 1.0,
) -> ReptilePrograms:
    """Build every program of a Reptile model for images of ``image_shape`` (H, W, C).

    ``inner_optimizer``: ``adam`` (beta1 = 0, the paper's) or ``sgd`` (plain gradient
    steps, no state carried between tasks).  ``weight_decay``: the reference's rate, by
    which the weights are multiplied before each inner step (1: none).  Variable names are
    the same in every build, so checkpoints load into a new process.
    """
    import paddle

    with paddle.utils.unique_name.guard():
        return _build_programs(
            image_shape, ways, model, inner_lr, seed, inner_optimizer, weight_decay
        )


def _build_programs(
    image_shape, ways, model, inner_lr, seed, inner_optimizer, weight_decay
) -> ReptilePrograms:
    import paddle
    import paddle.nn.functional as F

    paddle.enable_static()
    height, width, channels = image_shape
    startup, train = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = train.random_seed = seed + 1  # Paddle takes 0 as "unseeded"
    with paddle.static.program_guard(train, startup):
        x = paddle.static.data("x", [None, channels, height, width], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        logits = _network(x, ways, model, fused_norm=True)
        forward = train.clone()
        loss = F.cross_entropy(logits, y)
        if inner_optimizer == "sgd":
            optimizer = paddle.optimizer.SGD(learning_rate=inner_lr)
        else:
            optimizer = paddle.optimizer.Adam(
                learning_rate=inner_lr, beta1=0.0, beta2=0.999, epsilon=1e-8
            )
        optimizer.minimize(loss)

    infer, infer_startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(infer, infer_startup):
        infer_x = paddle.static.data("x", [None, channels, height, width], "float32")
        infer_logits = _network(infer_x, ways, model, fused_norm=False)

    params = [p.name for p in train.all_parameters() if p.trainable]
    state = sorted(
        v.name for v in train.list_vars() if v.persistable and v.name not in ("feed", "fetch")
    )
    shapes = {v.name: v.shape for v in train.list_vars() if v.persistable}
    dtypes = {v.name: v.dtype for v in train.list_vars() if v.persistable}

    def copies(pairs):
        return _assign_program(startup, pairs, shapes, dtypes)

    save_theta = copies([(p, p + THETA) for p in params])
    restore_theta = copies([(p + THETA, p) for p in params])
    snapshot = copies([(s, s + SNAP) for s in state])
    restore_snapshot = copies([(s + SNAP, s) for s in state])
    accumulate = _accumulate_program(startup, params, shapes)
    unaccumulate = _accumulate_program(startup, params, shapes, op="elementwise_sub")
    decay = _scale_program(startup, params, shapes, weight_decay) if weight_decay != 1 else None
    meta_update = _meta_update_program(startup, params, shapes)
    return ReptilePrograms(
        startup=startup,
        train=train,
        forward=forward,
        infer=infer,
        save_theta=save_theta,
        restore_theta=restore_theta,
        accumulate=accumulate,
        unaccumulate=unaccumulate,
        decay=decay,
        meta_update=meta_update,
        snapshot=snapshot,
        restore_snapshot=restore_snapshot,
        x=x,
        y=y,
        loss=loss,
        logits=logits,
        infer_x=infer_x,
        infer_logits=infer_logits,
        params=params,
        state=state,
    )


def _network(x, ways: int, model, fused_norm: bool):
    """The Reptile paper's conv net: ``model.layers`` x (conv, batch norm, [pool], ReLU), dense.

    With ``fused_norm`` batch norm is Paddle's fused op in training mode; without, it is
    spelt out in elementary ops over the same parameters, so an exported inference
    program also normalises with the batch's own statistics (Reptile is transductive).
    """
    import paddle
    import paddle.nn.functional as F
    from paddle import ParamAttr

    h = x
    for i in range(model.layers):
        h = paddle.static.nn.conv2d(
            h,
            model.filters,
            3,
            stride=model.stride,
            padding="SAME",
            param_attr=ParamAttr(name=f"conv{i}.w"),
            bias_attr=False,
        )
        if fused_norm:
            h = paddle.static.nn.batch_norm(
                h,
                is_test=False,
                epsilon=1e-3,
                momentum=0.99,
                param_attr=ParamAttr(name=f"norm{i}.scale"),
                bias_attr=ParamAttr(name=f"norm{i}.bias"),
                moving_mean_name=f"norm{i}.mean",
                moving_variance_name=f"norm{i}.var",
            )
        else:
            h = _batch_norm_ops(h, f"norm{i}", model.filters)
        if model.pool:
            h = F.max_pool2d(h, kernel_size=2, stride=2, padding="SAME")
        h = F.relu(h)
    h = paddle.flatten(h, 1)
    return paddle.static.nn.fc(
        h, ways, weight_attr=ParamAttr(name="dense.w"), bias_attr=ParamAttr(name="dense.b")
    )


def _batch_norm_ops(h, prefix: str, channels: int):
    import paddle

    scale = paddle.static.create_parameter([channels], "float32", name=prefix + ".scale")
    bias = paddle.static.create_parameter([channels], "float32", name=prefix + ".bias")
    mean = paddle.mean(h, axis=[0, 2, 3], keepdim=True)
    centred = paddle.subtract(h, mean)
    var = paddle.mean(paddle.square(centred), axis=[0, 2, 3], keepdim=True)
    normed = paddle.multiply(centred, paddle.rsqrt(paddle.scale(var, bias=1e-3)))
    scale = paddle.reshape(scale, [1, channels, 1, 1])
    bias = paddle.reshape(bias, [1, channels, 1, 1])
    return paddle.add(paddle.multiply(normed, scale), bias)


def _backup_var(block, startup, name, shape, dtype, value=0.0):
    """A persistable variable ``name`` in ``block`` that ``startup`` fills with ``value``."""
    var = block.create_var(name=name, shape=shape, dtype=dtype, persistable=True)
    sblock = startup.global_block()
    if not sblock.has_var(name):
        svar = sblock.create_var(name=name, shape=shape, dtype=dtype, persistable=True)
        sblock.append_op(
            type="fill_constant",
            outputs={"Out": [svar]},
            attrs={"shape": list(shape), "dtype": svar.dtype, "value": float(value)},
        )
    return var


def _assign_program(startup, pairs, shapes, dtypes):
    """A program that copies variable ``src`` to ``dst`` for each pair."""
    import paddle

    program = paddle.static.Program()
    block = program.global_block()
    for src, dst in pairs:
        base = src.split("@")[0]
        s = _backup_var(block, startup, src, shapes[base], dtypes[base])
        d = _backup_var(block, startup, dst, shapes[base], dtypes[base])
        block.append_op(type="assign", inputs={"X": [s]}, outputs={"Out": [d]})
    return program


def _accumulate_program(startup, params, shapes, op: str = "elementwise_add"):
    """acc <- acc + params (``op`` elementwise_sub: acc - params)."""
    import paddle

    program = paddle.static.Program()
    block = program.global_block()
    for p in params:
        pv = _backup_var(block, startup, p, shapes[p], "float32")
        acc = _backup_var(block, startup, p + ACC, shapes[p], "float32")
        block.append_op(
            type=op, inputs={"X": [acc], "Y": [pv]}, outputs={"Out": [acc]}, attrs={"axis": -1}
        )
    return program


def _scale_program(startup, params, shapes, rate: float):
    """params <- params * rate."""
    import paddle

    program = paddle.static.Program()
    block = program.global_block()
    for p in params:
        pv = _backup_var(block, startup, p, shapes[p], "float32")
        block.append_op(
            type="scale",
            inputs={"X": [pv]},
            outputs={"Out": [pv]},
            attrs={"scale": float(rate), "bias": 0.0},
        )
    return program


def _meta_update_program(startup, params, shapes):
    """theta <- a * theta + b * acc; params <- theta; acc <- 0.  Feeds ``a`` and ``b``.
    Each op writes its variable in place: five ops a parameter, no temporaries."""
    import paddle

    program = paddle.static.Program()
    with paddle.static.program_guard(program, paddle.static.Program()):
        a = paddle.static.data("meta_a", [1], "float32")
        b = paddle.static.data("meta_b", [1], "float32")
        block = program.global_block()

        def op(op_type, out, attrs=None, **inputs):
            block.append_op(
                type=op_type,
                inputs={k: [v] for k, v in inputs.items()},
                outputs={"Out": [out]},
                attrs=attrs or {},
            )

        for p in params:
            pv = _backup_var(block, startup, p, shapes[p], "float32")
            theta = _backup_var(block, startup, p + THETA, shapes[p], "float32")
            acc = _backup_var(block, startup, p + ACC, shapes[p], "float32")
            op("elementwise_mul", theta, {"axis": -1}, X=theta, Y=a)
            op("elementwise_mul", acc, {"axis": -1}, X=acc, Y=b)
            op("elementwise_add", theta, {"axis": -1}, X=theta, Y=acc)
            op("assign", pv, X=theta)
            op("fill_constant", acc, {"shape": list(shapes[p]), "dtype": acc.dtype, "value": 0.0})
    return program


def inner_batches(
    num_samples: int,
    batch_size: int,
    iterations: int,
    rng: np.random.Generator,
    replacement: bool = False,
) -> list[np.ndarray]:
    """Index batches for an inner loop: shuffled passes over the samples, as in the paper;
    with ``replacement`` each batch is drawn afresh from all samples (no repeat within it)."""
    if replacement:
        return [rng.choice(num_samples, size=batch_size, replace=False) for _ in range(iterations)]
    batches, order = [], np.array([], dtype=np.int64)
    for _ in range(iterations):
        while len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(num_samples)])
        batches.append(order[:batch_size])
        order = order[batch_size:]
    return batches


def tail_split(labels: np.ndarray, tail_shots: int) -> tuple[np.ndarray, np.ndarray]:
    """FOML's tail: the first ``tail_shots`` samples of each class, and the rest (indices)."""
    tail = np.concatenate([np.flatnonzero(labels == c)[:tail_shots] for c in np.unique(labels)])
    rest = np.setdiff1d(np.arange(len(labels)), tail)
    return rest, np.sort(tail)


def meta_step_size(iteration: int, total: int, initial: float, final: float) -> float:
    """The meta step eps at ``iteration``: linear from ``initial`` to ``final``."""
    frac = min(1.0, iteration / max(1, total))
    return frac * final + (1 - frac) * initial
