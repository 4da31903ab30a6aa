"""How a run speaks: the :class:`Reporter` stages report through, and ``say`` for a line;
what is non-finite (:func:`non_finite`), in what a run reports and in its model's
parameters (:func:`check_parameters`, at each checkpoint and at the end of training)."""

from __future__ import annotations

import math
import numbers
import sys
import threading

import numpy as np

from kspipe.errors import NonFiniteError
from kspipe.process import heartbeat


def say(message: str) -> None:
    """A message for the user, ``kspipe: <message>`` on standard error."""
    print(f"kspipe: {message}", file=sys.stderr, flush=True)


class Reporter:
    """What a stage reports goes through here to the lifecycle hooks (every observer).

    Every workload's losses and metrics pass here, so here a run whose training went
    non-finite is stopped: the first NaN or infinite value reported (a progress value or a
    metric: a number, or any element of an array, a numpy scalar or a Paddle tensor) is a
    :class:`NonFiniteError` naming it and its step, and never reaches the observers.  It
    is raised on the thread that runs the stages (the pipeline's, which made this
    reporter).  One reported from another thread (a monitor beside ``train_from_dataset``)
    is kept for the stages' thread: its next report raises it, and so does :meth:`check`,
    which the pipeline calls when the execute stage returns, with :meth:`check_model`
    (the model's parameters, before the export and the run's end).
    """

    def __init__(self, hook, run_dir: str):
        self._hook = hook
        self.run_dir = run_dir
        self.failure: NonFiniteError | None = None
        self._thread = threading.get_ident()
        self._lock = threading.Lock()

    def progress(self, task: str, step: int, total: int, values: dict | None = None) -> None:
        values = values or {}
        heartbeat.step(task, step)  # progress, for the launcher's watch of stalls
        if self._finite(values, f"at {task} step {step}"):
            self._hook.kspipe_progress(task=task, step=step, total=total, values=values)

    def metrics(self, metrics: dict, step: int) -> None:
        if self._finite(metrics, f"at step {step}"):
            self._hook.kspipe_log_metrics(metrics=dict(metrics), step=step)

    def artifact(self, path: str, artifact_path: str = "") -> None:
        self._hook.kspipe_log_artifact(path=path, artifact_path=artifact_path)

    def check(self, metrics: dict | None = None) -> None:
        """Raise the first non-finite value reported, from any thread, or else one of
        ``metrics`` (what the execute stage returned)."""
        if metrics is not None:
            self._finite(metrics, "in the execute stage's metrics")
        if self.failure is not None:
            raise self.failure

    def check_model(self, programs, scope) -> None:
        """Where the model's parameters in ``scope`` are not all finite, a
        :class:`NonFiniteError` naming the first that is not: what the pipeline asks of
        every workload when its execute stage returns, before the export.  ``programs`` is
        what the workload's compile stage returned; its parameters are those of every
        ``paddle.static.Program`` it is or holds (as an attribute, or in a list or dict
        there).  The model's other state (the optimiser's) and the tables a mode keeps
        outside the workers (a parameter server's) are not read."""
        check_parameters(model_parameters(programs, scope), "at the end of training")

    @staticmethod
    def say(message: str) -> None:
        say(message)

    def _finite(self, values: dict, where: str) -> bool:
        """Whether every number of ``values`` is finite.  A value that is not becomes the
        run's failure, if it is the first; on the stages' thread a failure is raised."""
        bad = next(
            ((name, problem) for name, value in values.items() if (problem := non_finite(value))),
            None,
        )
        if bad is not None:
            with self._lock:
                if self.failure is None:
                    self.failure = NonFiniteError(f"{bad[0]} {bad[1]} {where}")
        if self.failure is not None and threading.get_ident() == self._thread:
            raise self.failure
        return bad is None


def non_finite(value) -> str:
    """What of ``value`` is NaN or infinite, said after its name (``is nan``, ``holds inf
    (element [2, 0]; 3 of its 64 values are not finite)``); '' where all is finite, or
    ``value`` holds no numbers (a string).  A number, a numpy array or scalar, a Paddle
    tensor (whatever numpy reads), a list of numbers."""
    if isinstance(value, numbers.Real):  # numpy's float scalars too
        return "" if math.isfinite(value) else f"is {float(value)}"
    if isinstance(value, (str, bytes)) or not (
        hasattr(value, "__array__") or isinstance(value, (list, tuple))
    ):
        return ""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError):  # a ragged list, a tensor not initialised
        return ""
    if array.dtype.kind not in "fc":  # whole numbers and booleans are always finite
        return ""
    bad = ~np.isfinite(array)
    if not bad.any():
        return ""
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    first = array[where]
    shown = float(first) if array.dtype.kind == "f" else complex(first)
    if array.size == 1:
        return f"is {shown}"
    count = f"{int(bad.sum())} of its {array.size} values are not finite"
    return f"holds {shown} (element {list(where)}; {count})"


def check_parameters(parameters, where: str) -> None:
    """A :class:`NonFiniteError` for the first of ``parameters`` (name, array pairs, or a
    dict of them) with a NaN or infinite value: ``parameter <name> is nan <where>``.

    Its cost, measured for the Reptile model (omniglot_5way: 22 parameters, 128,389
    values; 2-core EPYC, 2026-12-07): 0.06 ms at a checkpoint, over the arrays it copied
    already (the copy: 3.2 ms); 0.5 ms at the end of training, copying them out of the
    scope (:func:`model_parameters`)."""
    items = parameters.items() if isinstance(parameters, dict) else parameters
    for name, array in items:
        problem = non_finite(array)
        if problem:
            raise NonFiniteError(f"parameter {name} {problem} {where}")


def model_parameters(programs, scope):
    """``(name, array)`` of each parameter of the programs among ``programs`` that ``scope``
    holds as an initialised dense tensor (a table a mode keeps elsewhere is not here), one
    at a time."""
    import paddle

    found = [programs] if isinstance(programs, paddle.static.Program) else []
    for value in getattr(programs, "__dict__", {}).values():
        inner = value.values() if isinstance(value, dict) else value
        inner = inner if isinstance(inner, (list, tuple, type({}.values()))) else [value]
        found += [p for p in inner if isinstance(p, paddle.static.Program)]
    names = dict.fromkeys(p.name for program in found for p in program.all_parameters())
    for name in names:
        variable = scope.find_var(name)
        try:
            tensor = variable.get_tensor() if variable is not None else None
            if tensor is None or not tensor._is_initialized():
                continue
        except (ValueError, RuntimeError):  # another kind of variable (SelectedRows ...)
            continue
        yield name, np.array(tensor)
