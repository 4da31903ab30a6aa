"""A Reptile model in a Paddle scope adapting to tasks: the inner loops, one task at a time
or several side by side, and the adapted model's predictions.

:class:`Adapter` needs no data set, reporter or role: it is what serving adapts per
request (:mod:`kspipe.reptile.serving`), and what meta-training
(:class:`kspipe.reptile.learner.ReptileLearner`) and evaluation
(:mod:`kspipe.reptile.evaluation`) build on.
"""

from __future__ import annotations

import contextlib

import numpy as np

from kspipe import checkpoint
from kspipe.reptile.lanes import Lane, child_lane
from kspipe.reptile.programs import inner_batches


class Adapter:
    """One Reptile model (``programs``) in ``scope``, run by ``executor``: adapted to a
    task's support set, then classifying its queries."""

    def __init__(self, cfg, programs, executor, scope):
        self.cfg = cfg
        self.p = programs
        self.exe = executor
        self.scope = scope
        self.lane = Lane(executor, scope)  # this model's own, run on the calling thread
        self._lanes = []  # the lanes that adapt groups of tasks on threads of their own

    def run(self, program, feed=None, fetch=()):
        return self.lane.run(program, feed, fetch)

    def lanes(self, count: int, together) -> list:
        """``count`` lanes for adapting groups of tasks with ``together``'s programs at once,
        each on its own thread: lanes with child scopes of this model's scope that hold
        their own copies of the slot variables (and read theta and the optimiser state
        from it); none for one (this model's own lane adapts on the calling thread).  This
        model's executor never runs on theirs: an executor that runs on two threads under
        Paddle's serial executor crashed in oneDNN (:mod:`kspipe.reptile.lanes`)."""
        if count <= 1:
            return []
        while len(self._lanes) < count:
            self._lanes.append(child_lane(self.scope, self.exe.place, together))
        return self._lanes[:count]

    def close(self) -> None:
        """Stop the lanes' threads (the model is not used after)."""
        for lane in self._lanes:
            lane.close()

    def together(self, tasks: int):
        """The programs that adapt ``tasks`` tasks side by side, or None (one at a time).
        Those only evaluation uses are built the first time asked for, their slots then
        made in this model's scope as :meth:`initialize` makes the others'."""
        if tasks in self.p.later:
            together = self.p.later[tasks]()
            self.run(together.startup)
            self.p.batched[tasks] = together
            del self.p.later[tasks]
        return self.p.batched.get(tasks)

    def initialize(self) -> None:
        """Run the startup programs and record theta."""
        self.run(self.p.startup)
        for together in self.p.batched.values():
            self.run(together.startup)
        self.run(self.p.save_theta)

    def load_state(self, path: str, key: str) -> None:
        """The state of the checkpoint ``path`` (or the newest one in a folder), theta
        included; ``key`` is the setting that named ``path``, for the messages."""
        checkpoint.load(self.p.train, self.scope, path, key)
        self.run(self.p.save_theta)

    def values(self, names) -> list:
        """The values of variables ``names`` in the scope, as numpy arrays."""
        return [np.array(self.scope.find_var(n).get_tensor()) for n in names]

    def state(self) -> dict:
        """Every persistable of the model held in the scope (theta, the optimiser's state),
        as numpy arrays: what evaluating it depends on."""
        names = sorted(checkpoint.held_names(self.p.train, self.scope))
        return dict(zip(names, self.values(names)))

    @contextlib.contextmanager
    def holding(self, state: dict):
        """The model is ``state`` (of :meth:`state`) within the block, as before after it."""
        current = self.state()
        self._take(state)
        try:
            yield
        finally:
            self._take(current)

    def _take(self, state: dict) -> None:
        for name, value in state.items():
            self.lane.set(name, value)
        self.run(self.p.save_theta)

    # --- inner loops ----------------------------------------------------------------

    def adapt(
        self, x: np.ndarray, y: np.ndarray, batch: int, iterations: int, rng: np.random.Generator
    ) -> float:
        """Inner loop: ``iterations`` steps on batches of (x, y); returns the last loss."""
        return self.steps(
            x, y, inner_batches(len(x), batch, iterations, rng, self.cfg.train.replacement)
        )

    def steps(self, x: np.ndarray, y: np.ndarray, batches: list, foml: bool = False) -> float:
        """One inner step per batch of indices (weight decay first, if any); returns the last
        loss.  ``foml``: accumulate only the last step's change (first-order MAML)."""
        loss = float("nan")
        y = y.reshape(-1, 1)
        for k, idx in enumerate(batches):
            last = k == len(batches) - 1
            if last and foml:
                self.run(self.p.unaccumulate)
            if self.p.decay is not None:
                self.run(self.p.decay)
            fetch = [self.p.loss] if last else []
            out = self.run(self.p.train_program, {"x": x[idx], "y": y[idx]}, fetch)
            if fetch:
                loss = float(np.asarray(out[0]).mean())
        return loss

    def adapt_together(
        self, together, tasks: list, batch: int, iterations: int, lane=None
    ) -> float:
        """The inner loops of ``tasks`` ((x, y, rng) each, as many as ``together`` holds)
        side by side, each from the model's current state, as :meth:`adapt` starts each
        one; the slots (of ``lane``, by default this model's own) then hold the adapted
        copies.  Returns the mean last loss."""
        lane = lane or self.lane
        run = lane.run
        batches = [
            inner_batches(len(x), batch, iterations, rng, self.cfg.train.replacement)
            for x, _, rng in tasks
        ]
        run(together.spread)
        loss = float("nan")
        for k in range(iterations):
            if together.decay is not None:
                run(together.decay)
            feed = together.stack(
                [x[b[k]] for (x, _, _), b in zip(tasks, batches)],
                [y[b[k]] for (_, y, _), b in zip(tasks, batches)],
            )
            fetch = [together.loss] if k == iterations - 1 else []
            out = run(together.train_program(lane.scope), feed, fetch)
            if fetch:
                loss = float(np.asarray(out[0]).sum()) / len(tasks)
        return loss

    # --- predictions ----------------------------------------------------------------

    def predict(self, x: np.ndarray) -> np.ndarray:
        (logits,) = self.run(self.p.forward, {"x": x}, [self.p.logits])
        return np.asarray(logits)

    def classify(self, support_x: np.ndarray, query_x: np.ndarray) -> np.ndarray:
        """The class of each query after adapting on the support set.

        Transductive (``eval.transductive``, the default): the queries form one batch, so
        batch norm shares their statistics.  Otherwise each query is classified alone, in a
        batch of the support images and itself (the reference implementation's
        non-transductive evaluation): nothing passes between queries.
        """
        return self.query_logits(support_x, query_x).argmax(axis=1)

    def query_logits(self, support_x: np.ndarray, query_x: np.ndarray) -> np.ndarray:
        """The logits :meth:`classify` decides by."""
        if self.cfg.eval.transductive:
            return self.predict(query_x)
        return np.stack([self.predict(np.concatenate([support_x, q[None]]))[-1] for q in query_x])
