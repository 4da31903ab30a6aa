"""The collective mode's one exchange a step: many tensors summed over the workers at once.

A program that all-reduced each gradient (or parameter) on its own paid one exchange
between the workers per tensor, and on CPU an exchange through gloo costs far more than
the arithmetic around it (each is a wait for the other processes, woken by the kernel).
:func:`append_sum` appends to a block, for a list of variables, the ops that replace each
by its sum over the workers (times a scale), with one exchange per dtype:

* ``coalesce_tensor`` copies the variables into one flat buffer and points each of them
  at its own part of it (so what is written to the buffer is what they hold), as Paddle's
  own fused all-reduce does;
* one exchange sums the buffer.  On CPU, with the role's ``chain`` given, a ``py_func``
  op hands it to the workers' chain of kspipe's own sockets
  (:class:`kspipe.modes.summing.WorkerSum`: worker order, a link carries the buffer once
  each way whatever the workers' number), which on CPU answers in a fraction of gloo's
  time (BENCHMARKS.md); else through gloo (or NCCL): for a small buffer an all-gather of
  every worker's buffer (one pass round the ring) and ``reduce_sum`` over the workers, in
  worker order; for a large one ``c_allreduce_sum``, the ring, whose bytes per worker do not
  grow with the workers (:data:`GATHER_BYTES` chooses);
* one ``scale`` op multiplies the whole buffer (1/workers: the mean);
* a ``depend`` op per variable tells Paddle's executor that what reads the variable
  reads the buffer's result (it orders ops by the variables they name, so without it an
  optimiser op could run before the exchange ends).

Every worker ends with the same values.  With two workers they equal, bit for bit, the
per-tensor all-reduce's (each element is the same two numbers added, then scaled); with
more, the chain and the all-gather add in worker order and gloo's ring in the order of its
segments, so they can differ by float rounding.
"""

from __future__ import annotations

import numpy as np

#: The largest buffer, in bytes times (workers - 1), that is summed by all-gathering it: up
#: to this the exchange's latency outweighs its bytes (two workers on the 2-core EPYC:
#: 420 weights 1.05 ms gathered against 2.1 ms through the ring, equal near 20,000).
GATHER_BYTES = 64 * 1024
#: The largest buffer, in bytes, summed along the workers' chain of kspipe's own sockets
#: (a ``py_func`` op) where a role gives one: every buffer (its bytes a link match gloo's
#: ring's, and it answers sooner: BENCHMARKS.md); the tests and benches lower it to
#: compare with gloo's ways.
CHAIN_BYTES = 1 << 40


def append_sum(
    block,
    variables,
    nranks: int,
    scale: float | None = None,
    zero: bool = False,
    chain=None,
):
    """Append to ``block`` the ops that replace each of ``variables`` (the block's variables,
    initialised when the ops run) by its sum over the ``nranks`` workers, times ``scale``;
    ``zero`` zeroes this worker's values first (a sum that is the other workers' alone).
    ``chain``: a function that sums an array over the workers (every worker calls it in
    step; :class:`kspipe.modes.summing.WorkerSum`), used where a buffer is at most
    :data:`CHAIN_BYTES`."""
    for group in by_dtype(variables):
        buffer = coalesce(block, group)
        if zero:
            append_scale(block, buffer, 0.0)
        if chain is not None and buffer_bytes(group) <= CHAIN_BYTES:
            append_chain_sum(block, buffer, chain, 1.0 if scale is None else scale)
            scale = None
        elif buffer_bytes(group) * (nranks - 1) <= GATHER_BYTES:
            append_gathered_sum(block, buffer, nranks)
        else:
            block.append_op(
                type="c_allreduce_sum",
                inputs={"X": [buffer]},
                outputs={"Out": [buffer]},
                attrs={"ring_id": 0, "use_calc_stream": True},
            )
        if scale is not None:
            append_scale(block, buffer, scale)
        for var in group:
            # the views share the buffer's memory, which Paddle's executor does not see: an
            # op that reads one of them must wait for the last op on the buffer (the
            # executor orders ops by the variables they read and write, not by the program)
            block.append_op(
                type="depend",
                inputs={"X": [var], "Dep": [buffer]},
                outputs={"Out": [var]},
            )


def by_dtype(variables) -> list[list]:
    """The variables in groups of one dtype each, in the order they come."""
    groups: dict = {}
    for var in variables:
        groups.setdefault(var.dtype, []).append(var)
    return list(groups.values())


def elements(var) -> int:
    return int(np.prod(var.shape))


def buffer_bytes(group) -> int:
    from paddle.base import core

    return sum(elements(v) for v in group) * core.size_of_dtype(group[0].dtype)


def coalesce(block, group):
    """A flat buffer of ``group``'s values in order, each variable a view of its part."""
    from paddle.utils import unique_name

    buffer = block.create_var(
        name=unique_name.generate("kspipe_fused"),
        shape=[sum(elements(v) for v in group)],
        dtype=group[0].dtype,
        persistable=False,
    )
    block.append_op(
        type="coalesce_tensor",
        inputs={"Input": group},
        outputs={"Output": group, "FusedOutput": [buffer]},
        # no alignment: the parts follow each other, so the buffer is exactly their values
        attrs={"copy_data": True, "use_align": False, "dtype": group[0].dtype},
    )
    return buffer


def append_gathered_sum(block, buffer, nranks: int) -> None:
    """``buffer`` := the sum of every worker's ``buffer``, in worker order (all-gathered)."""
    from paddle.utils import unique_name

    count = buffer.shape[0]

    def temporary(stem, shape):
        return block.create_var(
            name=unique_name.generate(stem), shape=shape, dtype=buffer.dtype, persistable=False
        )

    gathered = temporary("kspipe_gathered", [nranks * count])
    rows = temporary("kspipe_gathered_rows", [nranks, count])
    block.append_op(
        type="c_allgather",
        inputs={"X": [buffer]},
        outputs={"Out": [gathered]},
        attrs={"ring_id": 0, "nranks": nranks, "use_calc_stream": True},
    )
    block.append_op(
        type="reshape2",
        inputs={"X": [gathered]},
        outputs={"Out": [rows], "XShape": [temporary("kspipe_gathered_shape", [0])]},
        attrs={"shape": [nranks, count]},
    )
    block.append_op(
        type="reduce_sum",
        inputs={"X": [rows]},
        outputs={"Out": [buffer]},
        attrs={"dim": [0], "keep_dim": False, "reduce_all": False},
    )


def append_chain_sum(block, buffer, chain, scale: float) -> None:
    """``buffer`` := ``scale`` times the sum of every worker's ``buffer``, summed by
    ``chain`` in a ``py_func`` op (into a temporary: the op's output gets new memory, and
    the buffer's must stay the one its views share), then scaled back into it."""
    import paddle
    from paddle.utils import unique_name

    summed = block.create_var(
        name=unique_name.generate("kspipe_chained"),
        shape=buffer.shape,
        dtype=buffer.dtype,
        persistable=False,
    )

    def forward(values):
        return chain(np.array(values))

    with paddle.static.program_guard(block.program):
        paddle.static.py_func(forward, x=buffer, out=summed)
    block.append_op(
        type="scale", inputs={"X": [summed]}, outputs={"Out": [buffer]}, attrs={"scale": scale}
    )


def append_scale(block, var, scale: float) -> None:
    block.append_op(
        type="scale", inputs={"X": [var]}, outputs={"Out": [var]}, attrs={"scale": float(scale)}
    )
