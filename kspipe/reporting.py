"""How a run speaks: the :class:`Reporter` stages report through, and ``say`` for a line."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """A message for the user, ``kspipe: <message>`` on standard error."""
    print(f"kspipe: {message}", file=sys.stderr, flush=True)


class Reporter:
    """What a stage reports goes through here to the lifecycle hooks (every observer)."""

    def __init__(self, hook, run_dir: str):
        self._hook = hook
        self.run_dir = run_dir

    def progress(self, task: str, step: int, total: int, values: dict | None = None) -> None:
        self._hook.kspipe_progress(task=task, step=step, total=total, values=values or {})

    def metrics(self, metrics: dict, step: int) -> None:
        self._hook.kspipe_log_metrics(metrics=dict(metrics), step=step)

    def artifact(self, path: str, artifact_path: str = "") -> None:
        self._hook.kspipe_log_artifact(path=path, artifact_path=artifact_path)

    @staticmethod
    def say(message: str) -> None:
        say(message)
