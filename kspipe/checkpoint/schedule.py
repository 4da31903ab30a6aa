"""When to checkpoint: every so many steps, every so many minutes of wall-clock time, or both.

A training loop asks :meth:`Schedule.due` after each step (every worker, every step) and
writes a checkpoint when it answers True::

    schedule = Schedule(every=cfg.train.checkpoint_every,
                        minutes=cfg.train.checkpoint_minutes, start=first_step, role=role)
    for step in range(first_step + 1, last_step + 1):
        ...  # train one step
        if step < last_step and schedule.due(step):
            save_checkpoint(step)

**Why the time rule turns into steps in a cluster.**  A checkpoint of a cluster job holds
every worker's part and the servers' tables, so every worker must write it after the same
step: each settles the tables and waits for the others, and a worker that went on would
train against servers whose state the checkpoint is taking.  The workers' clocks do not
agree (they started a few milliseconds apart, and their steps take different times), so
no worker may decide by its own clock.  Here the workers agree, at moments every one of
them reaches after the same step, on how long a step takes (the slowest worker's time,
``role.all_gather``), and each turns the minutes into the same step number:

* after the first step of training: the step at which the first window's minutes will
  have passed, at the first step's pace;
* at each checkpoint, with every worker (they meet there anyway): the next window's step,
  at the pace of the whole window just ended.

Every worker computes the step from the same gathered numbers (the parameter servers'
gather is single precision: the same single-precision numbers on every worker), so it is
the same step on all of them.  Where the pace changes within a window (a learning-curve
point, a slower machine), that window ends before or after its minutes; the next one
follows the new pace.

That is one exchange of one number per checkpoint (and one at the start), nothing added
to a step, and nothing added to what the workers exchange each step; the other way,
the first worker deciding and its decision travelling with every step's exchange, would
have put a flag into each mode's exchange (the servers' tables, the collective sum, the
chain), each its own code.  The cost: the first window is planned from the first step,
which warm-up makes slow, so the first checkpoint comes early rather than late; later
windows follow the pace measured over the last window.

In one process there is nothing to agree on: the schedule reads its own clock.
"""

from __future__ import annotations

import time


class Schedule:
    """Checkpoints every ``every`` steps (0: none by steps) and every ``minutes`` of
    wall-clock time (None or 0: none by time), from ``start``, the step training begins at.

    ``role``: the job's role; with more than one worker the time rule is agreed as the
    module says, through ``role.all_gather`` (every worker must then call :meth:`due`
    after every step).  ``clock``: a function giving seconds (tests; else
    ``time.monotonic``).
    """

    def __init__(
        self, every: int = 0, minutes: float | None = None, start: int = 0, role=None, clock=None
    ):
        self.every = int(every or 0)
        self.seconds = float(minutes) * 60 if minutes else 0.0
        self.clock = clock = clock or time.monotonic
        self._agree = None
        if self.seconds and role is not None and role.worker_num() > 1:
            self._agree = lambda seconds: max(role.all_gather(float(seconds)))
        self._last = start  # the step of the last call
        self._from, self._since = start, clock()  # the window since the last checkpoint
        self._at: int | None = None  # in a cluster: the step that ends the window

    def due(self, step: int) -> bool:
        """Whether to checkpoint after ``step`` (steps done since the start of training,
        ``start`` included); a True starts the next window."""
        last, self._last = self._last, step
        by_steps = bool(self.every) and step // self.every > last // self.every
        if not self.seconds:
            return by_steps
        now = self.clock()
        elapsed = now - self._since
        if self._agree is None:
            by_time = elapsed >= self.seconds
        else:
            if self._at is None:  # the first window: planned at the first step's pace
                self._at = self._plan(step, self._agree(elapsed))
            by_time = step >= self._at
        if by_steps or by_time:
            if self._agree is not None:  # the next window, at the pace of this one
                self._at = step + self._steps(step, self._agree(elapsed))
            self._from, self._since = step, now
        return by_steps or by_time

    def _plan(self, step: int, seconds: float) -> int:
        return self._from + self._steps(step, seconds)

    def _steps(self, step: int, seconds: float) -> int:
        """The steps that take ``self.seconds`` at the pace of ``seconds`` for the steps
        from the window's start to ``step`` (at least one)."""
        per_step = max(seconds, 1e-9) / max(step - self._from, 1)
        return max(1, round(self.seconds / per_step))
