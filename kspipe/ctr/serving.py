"""The click-through model as a service: a table of impressions in, click probabilities out.

:class:`ClickModel` reads everything it needs from the exported inference model itself:
each feed variable is a slot, a LoD one (one sequence per instance) a sparse slot, a 2-D
one a dense slot of fixed width.  A request is a table whose columns are the slots (the
label is not one) and whose rows are impressions, as a MultiSlot line holds them: a sparse
slot's cell is a list of ids (or one id), a dense slot's a list of its values.  The answer
is one ``probability`` of a click per row, what kspipe's own evaluation computes for the
same line.
"""

from __future__ import annotations

import os

import numpy as np

from kspipe.errors import DataError
from kspipe.inference import MODEL_NAME
from kspipe.process.memory import threaded_executor


class ClickModel:
    """The exported click-through model, loaded once and run on each request.

    :param artifacts: ``{"inference_model": <the run's inference_model folder>}``.
    """

    def __init__(self, artifacts: dict):
        import paddle

        paddle.enable_static()
        threaded_executor()  # requests arrive on the server's threads (kspipe.process.memory)
        self.scope = paddle.static.Scope()
        self.executor = paddle.static.Executor(paddle.CPUPlace())
        with paddle.static.scope_guard(self.scope):
            self.program, self.slots, self.fetches = load(artifacts, self.executor)

    @staticmethod
    def artifacts(run_dir: str) -> dict:
        """What the MLflow model carries of the run folder ``run_dir``."""
        return {"inference_model": os.path.join(run_dir, "inference_model")}

    @staticmethod
    def example(artifacts: dict) -> dict:
        """A request of two impressions (made-up ids and values) and the shape of its
        answer; the id columns take uint64 values, which MLflow's ``long`` cannot hold."""
        import paddle
        import pandas as pd

        with paddle.static.scope_guard(paddle.static.Scope()):
            _, slots, _ = load(artifacts, paddle.static.Executor(paddle.CPUPlace()))
        return {
            "input": pd.DataFrame(
                {slot.name: [slot.example(1), slot.example(2)] for slot in slots}
            ),
            "output": pd.DataFrame({"probability": [0.5, 0.5]}),
            "params": {},
            "unchecked": [slot.name for slot in slots if slot.ids],
        }

    def predict(self, frame, params: dict):
        """The click probability of each row of ``frame``, as the column ``probability``."""
        import paddle
        import pandas as pd

        missing = [slot.name for slot in self.slots if slot.name not in frame.columns]
        if missing:
            raise DataError(
                f"the request has no column for the slot(s) {', '.join(missing)} "
                f"(the model reads {', '.join(s.name for s in self.slots)})"
            )
        feed = {slot.name: slot.feed(frame[slot.name].tolist()) for slot in self.slots}
        with paddle.static.scope_guard(self.scope):
            (pred,) = self.executor.run(
                self.program, feed=feed, fetch_list=self.fetches, scope=self.scope
            )
        return pd.DataFrame({"probability": np.asarray(pred, np.float64).reshape(-1)})


def load(artifacts: dict, executor) -> tuple:
    """The exported program (into the current scope), its slots and its fetch variables."""
    import paddle

    program, feeds, fetches = paddle.static.load_inference_model(
        os.path.join(artifacts["inference_model"], MODEL_NAME), executor
    )
    block = program.global_block()
    return program, [Slot(name, block.var(name)) for name in feeds], fetches


class Slot:
    """One feed variable of the click model: how a request's column becomes its feed."""

    def __init__(self, name: str, var):
        import paddle

        self.name = name
        self.ids = var.dtype == paddle.int64  # a uint64 slot (its ids wrap into int64)
        self.sparse = var.lod_level > 0
        self.width = 1 if self.sparse else int(var.shape[-1])

    def example(self, row: int) -> list:
        if self.ids:
            return [row * 7 + k for k in range(row if self.sparse else self.width)]
        return [0.5 * row] * (row if self.sparse else self.width)

    def feed(self, cells: list):
        """The feed of one column: a LoD tensor (sparse) or a (rows, width) array (dense)."""
        import paddle

        values = [self.values(cell, row) for row, cell in enumerate(cells)]
        flat = [v for row in values for v in row]
        if self.ids:  # ids above 2**63 wrap, as in Paddle's reader
            array = np.array(flat, dtype=np.uint64).view(np.int64)
        else:
            array = np.array(flat, dtype=np.float32)
        if not self.sparse:
            return array.reshape(len(values), self.width)
        return paddle.base.create_lod_tensor(
            array.reshape(-1, 1), [[len(v) for v in values]], paddle.CPUPlace()
        )

    def values(self, cell, row: int) -> list:
        """The values of one cell, checked as the MultiSlot reader checks a line."""
        values = list(cell) if isinstance(cell, (list, tuple, np.ndarray)) else [cell]
        where = f"row {row}, slot {self.name!r}"
        if not values:
            raise DataError(f"{where} is empty; every slot needs at least one value")
        if not self.sparse and len(values) != self.width:
            raise DataError(f"{where} has {len(values)} values; the dense slot takes {self.width}")
        convert = uint64 if self.ids else float
        try:
            return [convert(v) for v in values]
        except (TypeError, ValueError):
            kind = "uint64 ids" if self.ids else "numbers"
            raise DataError(f"{where} holds {cell!r}; it takes {kind}") from None


def uint64(value) -> int:
    """``value`` as an id: a whole number in uint64's range (JSON may give 7.0 for 7)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, np.integer, float, np.floating)
    ):
        raise TypeError(value)
    if isinstance(value, (float, np.floating)) and not float(value).is_integer():
        raise ValueError(value)
    number = int(value)
    if not 0 <= number < 2**64:
        raise ValueError(value)
    return number
