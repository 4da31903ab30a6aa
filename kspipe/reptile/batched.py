"""Several tasks adapted side by side in one program: the model's copies as grouped convolutions.

T tasks' copies of the weights are stacked slot by slot: a convolution's filters become
[T * out, in, k, k] run with ``groups=T``, batch norm's scale and bias [T * channels], the
dense layer a batched matmul over [T, features, ways].  Task t's images fill channel group
t of one input [batch, T * channels, H, W], so every layer, batch norm's statistics
included, sees only its own task, and the loss, the sum of each task's mean loss, gives
each copy its own gradient.  Adam (and SGD, and weight decay) act elementwise, so each slot
also keeps its own optimiser state.  One step of the T tasks is then one program run over
[batch, T * channels] images: each op's fixed cost is paid once instead of T times, which
on CPU is most of a step at batch 5 or 10 (measured in BENCHMARKS.md).

The slots live in variables of their own (``tasks<T>.<name>``); the model's variables stay
those of :mod:`kspipe.reptile.programs`, which checkpoints, modes and evaluation share:

* ``spread``: every slot <- the model's current state (parameters, Adam's moments and step
  counts): T tasks that start where the per-task path would restore each one;
* ``gather`` (meta-training): ``acc <- acc + sum of the slots' parameters``, for the usual
  meta step, and the optimiser's state <- the slots' mean moments and their step count.

A meta-batch shared among lanes on threads of their own (``train.threads``) gathers in
two programs instead: each lane's :func:`lane_gather` sums its slots into variables of
its own in the model's scope, and :func:`combine_lanes`, on the job's thread, makes of
every lane's sums what ``gather`` makes of one lane holding every task.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from kspipe.reptile.programs import ACC


@dataclass
class BatchedPrograms:
    """The programs that adapt ``tasks`` tasks together, over the slot variables."""

    tasks: int
    startup: object  # creates the slot variables
    train: object  # one step of every slot: feeds x [batch, T*C, H, W], y [T, batch, 1]
    forward: object  # logits [T, batch, ways] (batch statistics), no update
    spread: object  # every slot <- the model's state
    x: object
    y: object
    loss: object  # the sum over the slots of each task's mean loss
    logits: object
    decay: object = None  # slot parameters * train.weight_decay, before each step
    compile: object = None  # set by the compile stage: ``train`` -> a CompiledProgram of it
    pairs: list = field(default_factory=list)  # [(model variable, its slot variable)]
    params: tuple = ()  # the model's parameters' names (the rest of pairs is state)
    _gather: object = None
    _compiled: dict = field(default_factory=dict)  # scope -> the CompiledProgram run in it

    @property
    def gather(self):
        """acc += sum of the slots' parameters; optimiser state <- the slots' mean.  Built
        when first asked for (~0.2 s): evaluation never gathers, nor do the lanes that
        share a meta-batch (:func:`lane_gather`)."""
        if self._gather is None:

            def body(get):
                _gather(get, self.pairs, self.params, self.tasks)

            self._gather = _program(body, f"tasks{self.tasks}.gather.")
        return self._gather

    def train_program(self, scope):
        """What a step runs in ``scope``: ``train``, or with the compile stage's BuildStrategy
        options a CompiledProgram of it, one for each scope (Paddle binds a CompiledProgram
        to the scope it first ran in, and lanes that adapt with these programs at once each
        have a scope of their own)."""
        if self.compile is None:
            return self.train
        if scope not in self._compiled:
            self._compiled[scope] = self.compile(self.train)
        return self._compiled[scope]

    def stack(self, images: list, labels: list = None) -> dict:
        """The feed of one step: task t's images [batch, C, H, W] into channel group t."""
        import numpy as np

        x = np.stack(images, axis=1)
        feed = {"x": x.reshape(x.shape[0], -1, *x.shape[3:])}
        if labels is not None:
            feed["y"] = np.stack(labels).reshape(len(labels), -1, 1)
        return feed


def use_onednn_relu(*programs) -> None:
    """ReLU on oneDNN's kernels too: after oneDNN's grouped convolutions, Paddle's own ReLU
    kernels cost a fifth of a side-by-side step (BENCHMARKS.md); the same numbers."""
    for program in programs:
        for op in program.global_block().ops:
            if op.type in ("relu", "relu_grad"):
                op._set_attr("use_mkldnn", True)


def build_batched_programs(
    programs,
    tasks: int,
    image_shape,
    ways: int,
    model,
    inner_lr: float,
    inner_optimizer: str = "adam",
    weight_decay: float = 1.0,
) -> BatchedPrograms:
    """The programs that adapt ``tasks`` copies of ``programs``' model together; the
    other arguments are those :func:`~kspipe.reptile.programs.build_programs` took."""
    import paddle

    prefix = f"tasks{tasks}."
    with paddle.utils.unique_name.guard(prefix):
        return _build(
            programs,
            tasks,
            prefix,
            image_shape,
            ways,
            model,
            inner_lr,
            inner_optimizer,
            weight_decay,
        )


def _build(
    programs, tasks, prefix, image_shape, ways, model, inner_lr, inner_optimizer, weight_decay
) -> BatchedPrograms:
    import paddle
    import paddle.nn.functional as F

    paddle.enable_static()
    height, width, channels = image_shape
    startup, train = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(train, startup):
        x = paddle.static.data("x", [None, tasks * channels, height, width], "float32")
        y = paddle.static.data("y", [tasks, None, 1], "int64")
        logits = _grouped_network(x, tasks, prefix, ways, model)
        forward = train.clone()
        losses = F.cross_entropy(logits, y, reduction="none")  # [T, batch, 1]
        loss = paddle.sum(paddle.mean(losses, axis=[1, 2]))
        if inner_optimizer == "sgd":
            optimizer = paddle.optimizer.SGD(learning_rate=inner_lr)
        else:
            optimizer = paddle.optimizer.Adam(
                learning_rate=inner_lr, beta1=0.0, beta2=0.999, epsilon=1e-8, use_multi_tensor=True
            )
        optimizer.minimize(loss)

    model_vars = {v.name: v for v in programs.train.list_vars() if v.persistable}
    slots = {v.name: v for v in train.list_vars() if v.persistable and v.name.startswith(prefix)}
    pairs = [(model_vars[_unprefixed(name, prefix)], slot) for name, slot in sorted(slots.items())]
    params = [(m, s) for m, s in pairs if m.name in programs.params]
    decay = None
    if weight_decay != 1:
        decay = _program(
            lambda get: [
                paddle.assign(paddle.scale(get(s), weight_decay), get(s)) for _, s in params
            ]
        )
    return BatchedPrograms(
        tasks=tasks,
        startup=startup,
        train=train,
        forward=forward,
        spread=_program(lambda get: _spread(get, pairs, tasks)),
        decay=decay,
        x=x,
        y=y,
        loss=loss,
        logits=logits,
        pairs=pairs,
        params=tuple(programs.params),
    )


def _grouped_network(x, tasks: int, prefix: str, ways: int, model):
    """``programs._network`` for ``tasks`` slots: the same layers, over slot-major copies."""
    import paddle
    import paddle.nn.functional as F
    from paddle import ParamAttr

    h = x
    for i in range(model.layers):
        h = paddle.static.nn.conv2d(
            h,
            tasks * model.filters,
            3,
            stride=model.stride,
            padding="SAME",
            groups=tasks,
            bias_attr=False,
            param_attr=ParamAttr(name=f"{prefix}conv{i}.w"),
        )
        h = paddle.static.nn.batch_norm(
            h,
            is_test=False,
            epsilon=1e-3,
            momentum=0.99,
            param_attr=ParamAttr(name=f"{prefix}norm{i}.scale"),
            bias_attr=ParamAttr(name=f"{prefix}norm{i}.bias"),
            moving_mean_name=f"{prefix}norm{i}.mean",
            moving_variance_name=f"{prefix}norm{i}.var",
        )
        if model.pool:
            h = F.max_pool2d(h, kernel_size=2, stride=2, padding="SAME")
        h = F.relu(h)
    features = h.shape[1] // tasks * h.shape[2] * h.shape[3]
    h = paddle.transpose(paddle.reshape(h, [-1, tasks, features]), [1, 0, 2])  # [T, batch, f]
    weight = paddle.static.create_parameter(
        [tasks, features, ways], "float32", name=f"{prefix}dense.w"
    )
    bias = paddle.static.create_parameter(
        [tasks, 1, ways], "float32", name=f"{prefix}dense.b", is_bias=True
    )
    return paddle.add(paddle.bmm(h, weight), bias)


def _program(body, prefix: str = ""):
    """A program of ``body(get)``'s ops, where ``get(var)`` declares a scope variable in it;
    with ``prefix``, the names of its temporaries begin with it (programs built later than
    the side-by-side ones, outside their ``tasks<T>.`` names)."""
    import paddle

    program = paddle.static.Program()
    block = program.global_block()

    def get(var, name=None):
        name = name or var.name
        if block.has_var(name):
            return block.var(name)
        return block.create_var(name=name, shape=var.shape, dtype=var.dtype, persistable=True)

    names = paddle.utils.unique_name.guard(prefix) if prefix else contextlib.nullcontext()
    with names, paddle.static.program_guard(program, paddle.static.Program()):
        body(get)
    return program


def _spread(get, pairs, tasks):
    """Every slot <- the model's variable: T copies, task-major, or one where one serves
    all (Adam's step counts, the learning rate); each with one op into the slot."""
    import paddle

    for model_var, slot in pairs:
        value = get(model_var)
        if _size(slot) != _size(model_var):
            piece = [slot.shape[0] // tasks, *slot.shape[1:]]  # one task's part of the slot
            if piece != list(model_var.shape):
                value = paddle.reshape(value, piece)
            _into("concat", [value] * tasks, get(slot), axis=0)
        else:
            _into("assign", value, get(slot))


def _gather(get, pairs, params, tasks):
    """acc += the sum of the slots' parameters; the rest of the model's state <- the slots'
    mean (tiled variables) or the slots' common value."""
    import paddle

    for model_var, slot in pairs:
        if model_var.name in params:
            acc = get(model_var, model_var.name + ACC)
            _into("sum", [acc, *_by_task(get(slot), tasks, model_var.shape)], acc)
        elif _size(slot) != _size(model_var):
            total = paddle.add_n(_by_task(get(slot), tasks, model_var.shape))
            _into(
                "scale", total, get(model_var), scale=1.0 / tasks, bias=0.0, bias_after_scale=True
            )
        else:
            _into("assign", get(slot), get(model_var))


def lane_name(lane: int, name: str) -> str:
    """Where training lane ``lane`` leaves its share of the model variable ``name``."""
    return f"lane{lane}.{name}"


def lane_gather(together: BatchedPrograms, lane: int):
    """Training lane ``lane``'s share of the gather: for each model variable ``gather``
    sets, the sum of ``together``'s slots (parameters and tiled state) or their common
    value, into :func:`lane_name` variables, which the model's scope holds (a lane's child
    scope reads and writes them there)."""
    tasks = together.tasks

    def body(get):
        for model_var, slot in together.pairs:
            share = get(model_var, lane_name(lane, model_var.name))
            if model_var.name in together.params or _size(slot) != _size(model_var):
                _into("sum", _by_task(get(slot), tasks, model_var.shape), share)
            else:
                _into("assign", get(slot), share)

    return _program(body, f"lane{lane}.gather.")


def lane_shares(together: BatchedPrograms, lane: int) -> list[str]:
    """The names of the variables :func:`lane_gather` writes."""
    return [lane_name(lane, model_var.name) for model_var, _ in together.pairs]


def combine_lanes(lanes: list[BatchedPrograms]):
    """What ``gather`` leaves after one lane holding every task, from the shares that
    :func:`lane_gather` left for each of ``lanes`` (in order): acc += the sum of their
    parameters' sums; the tiled state <- the sum of their sums divided by the tasks (their
    mean over every task); a value every slot shares (step counts), the first lane's."""
    import paddle

    tasks = sum(together.tasks for together in lanes)
    first = lanes[0]

    def body(get):
        for model_var, slot in first.pairs:
            shares = [get(model_var, lane_name(i, model_var.name)) for i in range(len(lanes))]
            if model_var.name in first.params:
                acc = get(model_var, model_var.name + ACC)
                _into("sum", [acc, *shares], acc)
            elif _size(slot) != _size(model_var):
                _into(
                    "scale",
                    paddle.add_n(shares),
                    get(model_var),
                    scale=1.0 / tasks,
                    bias=0.0,
                    bias_after_scale=True,
                )
            else:
                _into("assign", shares[0], get(model_var))

    return _program(body, "lanes.combine.")


def _into(op_type: str, x, out, **attrs) -> None:
    """One ``op_type`` op of ``x`` (a variable or a list of them) that writes straight
    into the scope variable ``out`` (no temporary, no copy after it: each op of a program
    costs its first run ~3 ms)."""
    out.block.append_op(
        type=op_type,
        inputs={"X": x if isinstance(x, list) else [x]},
        outputs={"Out": [out]},
        attrs=attrs,
    )


def _by_task(slot, tasks: int, shape) -> list:
    """Each task's copy in ``slot``, of the model variable's ``shape``.  Summed with one
    ``sum`` op: a copy along the first axis and an add, where Paddle's ``reduce_sum``
    over the tasks' axis of a convolution's [T, out, in, k, k] was 5% of a training
    job's CPU time (BENCHMARKS.md)."""
    import paddle

    return list(paddle.unbind(paddle.reshape(slot, [tasks, *shape]), axis=0))


def _unprefixed(name: str, prefix: str) -> str:
    """A slot variable's model variable: Adam's names take the prefix twice."""
    while name.startswith(prefix):
        name = name[len(prefix) :]
    return name


def _size(var) -> int:
    size = 1
    for d in var.shape:
        size *= d
    return size
