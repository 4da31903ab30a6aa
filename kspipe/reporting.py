"""How a run speaks: the :class:`Reporter` stages report through, and ``say`` for a line."""

from __future__ import annotations

import math
import numbers
import sys
import threading

from kspipe.errors import NonFiniteError
from kspipe.process import heartbeat


def say(message: str) -> None:
    """A message for the user, ``kspipe: <message>`` on standard error."""
    print(f"kspipe: {message}", file=sys.stderr, flush=True)


class Reporter:
    """What a stage reports goes through here to the lifecycle hooks (every observer).

    Every workload's losses and metrics pass here, so here a run whose training went
    non-finite is stopped: the first NaN or infinite value reported (a progress value or a
    metric) is a :class:`NonFiniteError` naming it and its step, and never reaches the
    observers.  It is raised on the thread that runs the stages (the pipeline's, which made
    this reporter).  One reported from another thread (a monitor beside
    ``train_from_dataset``) is kept for the stages' thread: its next report raises it, and
    so does :meth:`check`, which the pipeline calls when the execute stage returns.
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

    @staticmethod
    def say(message: str) -> None:
        say(message)

    def _finite(self, values: dict, where: str) -> bool:
        """Whether every number of ``values`` is finite.  A value that is not becomes the
        run's failure, if it is the first; on the stages' thread a failure is raised."""
        bad = next(
            (
                (name, value)
                for name, value in values.items()
                if isinstance(value, numbers.Real) and not math.isfinite(value)
            ),
            None,
        )
        if bad is not None:
            with self._lock:
                if self.failure is None:
                    self.failure = NonFiniteError(f"{bad[0]} is {float(bad[1])} {where}")
        if self.failure is not None and threading.get_ident() == self._thread:
            raise self.failure
        return bad is None
