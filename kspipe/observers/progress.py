"""A progress display on standard error: what runs, how far, its figures, the time left.

On a terminal one line is rewritten in place; otherwise (a log file, CI) a line is
printed every ``KSPIPE_PROGRESS_SECONDS`` seconds (default 10) and at the end.
"""

from __future__ import annotations

import os
import sys
import time

from kspipe import hookimpl


class ProgressLine:
    """The built-in plugin ``progress``: one display, on ``stream`` (standard error)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.every = (
            0.2 if self.interactive else float(os.environ.get("KSPIPE_PROGRESS_SECONDS", 10))
        )
        self.task = None
        self.started = 0.0
        self.first_step = 0
        self.last_shown = 0.0

    @hookimpl
    def kspipe_progress(self, task, step, total, values):
        self.update(task, step, total, values)

    def update(self, task: str, step: int, total: int, values: dict) -> None:
        now = time.monotonic()
        if task != self.task:
            self.task, self.started, self.first_step, self.last_shown = task, now, step - 1, 0.0
        done = step >= total
        if not done and now - self.last_shown < self.every:
            return
        self.last_shown = now
        line = self.format(task, step, total, values, now - self.started)
        if self.interactive:
            self.stream.write("\r\x1b[2K" + line + ("\n" if done else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def format(self, task, step, total, values, elapsed) -> str:
        parts = [f"{task} {step}/{total}"]
        for name, value in values.items():
            parts.append(f"{name} {value:.3f}" if isinstance(value, float) else f"{name} {value}")
        rate_steps = step - self.first_step
        if step < total and rate_steps > 0:
            parts.append(f"left {_duration(elapsed / rate_steps * (total - step))}")
        else:
            parts.append(f"took {_duration(elapsed)}")
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
