"""A run's checkpoint folders: which are complete, the newest, and which to prune.

``<folder>/checkpoint-<step>`` is complete once it has its final name; one being written
is named ``<name>.tmp``.  The parts other workers write of a checkpoint are beside it, in
``<folder>/worker-<i>/checkpoint-<step>``.
"""

from __future__ import annotations

import os
import shutil

from kspipe.errors import ConfigError

UNFINISHED = ".tmp"  # a checkpoint being written


def stale(folder: str, keep: int, follows: str | None = None) -> list[str]:
    """The checkpoints of ``folder`` to remove once a new one is complete there.

    Alone, all but the newest ``keep``, with the parts other workers wrote beside each
    (``worker-<i>/<its name>``).  Where ``folder`` holds parts of the checkpoints in
    ``follows``: those whose checkpoint is gone and will not come (an older one than its
    newest complete checkpoint).  A part is written, whole, before its checkpoint, whose
    files may still be on their way on the first worker's thread: it stays until that
    checkpoint is complete and then until it is pruned, so every checkpoint a resume may
    find has every part, whatever ``keep`` is (1 included)."""
    mine = sorted(checkpoints(folder))
    if follows is None:
        old = mine[:-keep] if keep > 0 else mine
        parts = [
            os.path.join(folder, worker, os.path.basename(path))
            for path in old
            for worker in _worker_folders(folder)
        ]
        return old + [p for p in parts if os.path.isdir(p)]
    complete = {os.path.basename(p) for p in checkpoints(follows)}
    newest = max(complete, default="")
    return [p for p in mine if os.path.basename(p) not in complete and os.path.basename(p) < newest]


def _worker_folders(folder: str) -> list[str]:
    try:
        return [n for n in os.listdir(folder) if n.startswith("worker-")]
    except OSError:
        return []


def checkpoints(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return [
        os.path.join(folder, n)
        for n in os.listdir(folder)
        if n.startswith("checkpoint-") and not n.endswith(UNFINISHED)
    ]


def discard_unfinished(run_dir: str) -> None:
    """Remove the checkpoints that were being written anywhere in ``run_dir`` (a process
    killed mid-write leaves one; the complete ones are untouched)."""
    for folder, names, _ in os.walk(run_dir):
        for name in [n for n in names if n.startswith("checkpoint-") and n.endswith(UNFINISHED)]:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            names.remove(name)


def latest(path: str, key: str = "resume") -> str:
    """``path`` itself if it is a checkpoint, else its newest checkpoint (or its run's)."""
    if os.path.isfile(os.path.join(path, "progress.json")):
        return path
    for folder in (path, os.path.join(path, "checkpoints")):
        found = sorted(checkpoints(folder))
        if found:
            return found[-1]
    if not os.path.exists(path):
        raise ConfigError(f"{key}={path}: no such folder")
    raise ConfigError(f"{key}={path}: no checkpoint found there")
