"""A progress display on standard error: what runs, how far, its figures, the time left.

On a terminal one line is rewritten in place; otherwise (a log file, CI) a line is
printed every ``KSPIPE_PROGRESS_SECONDS`` seconds (default 10) and at the end.

Each task (``meta-train``, ``evaluate`` ...) is a phase of its own, timed on the wall clock
from its start to its last step, however often other tasks interrupt it (a learning
curve's evaluations within ``meta-train``): ``took`` is that whole time, and ``left`` the
steps to go at the pace the phase has kept so far, interruptions included.  A task reports
its first step once it is done, so its phase began when the display last heard of
anything else (another task's step, a stage's start).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from kspipe import hookimpl


@dataclass
class Phase:
    """A task's phase: when it began, and its first step seen, when (its pace's start)."""

    began: float
    first_step: int
    first_seen: float
    step: int

    def left(self, step: int, total: int, now: float) -> float | None:
        """The time to go at the pace since its first step seen; None before a second."""
        if step <= self.first_step:
            return None
        return (now - self.first_seen) / (step - self.first_step) * (total - step)


class ProgressLine:
    """The built-in plugin ``progress``: one display, on ``stream`` (standard error), timed
    by ``clock`` (seconds)."""

    def __init__(self, stream=None, clock=time.monotonic):
        self.stream = stream or sys.stderr
        self.clock = clock
        self.interactive = self.stream.isatty()
        self.every = (
            0.2 if self.interactive else float(os.environ.get("KSPIPE_PROGRESS_SECONDS", 10))
        )
        self.phases: dict[str, Phase] = {}
        self.last_event = clock()  # when the display last heard of anything
        self.last_shown = 0.0

    @hookimpl
    def kspipe_progress(self, task, step, total, values):
        self.update(task, step, total, values)

    @hookimpl
    def kspipe_before_stage(self, stage, cfg):
        self.last_event = self.clock()  # a task reported next began no earlier

    def update(self, task: str, step: int, total: int, values: dict) -> None:
        now = self.clock()
        phase = self.phases.get(task)
        new = phase is None or step < phase.step  # a new phase (or the task again, anew)
        if new:
            phase = self.phases[task] = Phase(self.last_event, step, now, step)
        phase.step = step
        self.last_event = now
        done = step >= total
        if done:
            del self.phases[task]
        elif not new and now - self.last_shown < self.every:
            return
        self.last_shown = now
        left = None if done else phase.left(step, total, now)
        line = self.format(task, step, total, values, now - phase.began, left)
        if self.interactive:
            self.stream.write("\r\x1b[2K" + line + ("\n" if done else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    @staticmethod
    def format(task, step, total, values, elapsed, left=None) -> str:
        """The line: ``took`` (``elapsed``) once the task is done, else ``left`` if known."""
        parts = [f"{task} {step}/{total}"]
        for name, value in values.items():
            parts.append(f"{name} {value:.3f}" if isinstance(value, float) else f"{name} {value}")
        if step >= total:
            parts.append(f"took {_duration(elapsed)}")
        elif left is not None:
            parts.append(f"left {_duration(left)}")
        return " | ".join(parts)


def _duration(seconds: float) -> str:
    """``0.4s`` (a short evaluation took some time, not none), ``12s``, ``3m05s``, ``1h02m``."""
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
