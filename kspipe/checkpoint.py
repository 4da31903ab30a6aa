"""Checkpoints: every persistable of a program plus a progress record, written atomically.

``<folder>/checkpoint-<step>/state.pd*``, ``progress.json`` and ``config.yaml`` (the resolved
config that produced it, so a checkpoint describes itself); a checkpoint is written
under a ``.tmp`` name and renamed, so a process that dies while writing leaves the last
complete one in place.  ``resume=<run folder>`` (or a checkpoint folder) continues from
the newest.
"""

from __future__ import annotations

import json
import os
import shutil

from kspipe.errors import ConfigError
from kspipe.files import user_path


def save(program, scope, folder: str, step: int, progress: dict, keep: int, cfg) -> str:
    """Write ``program``'s persistables in ``scope``, ``progress`` and the resolved ``cfg``;
    keep the newest ``keep``."""
    import paddle
    from omegaconf import OmegaConf

    final = os.path.join(folder, f"checkpoint-{step:07d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with paddle.static.scope_guard(scope):
        paddle.static.save(program, os.path.join(tmp, "state"))
    with open(os.path.join(tmp, "progress.json"), "w") as f:
        json.dump(progress, f)
    OmegaConf.save(cfg, os.path.join(tmp, "config.yaml"), resolve=True)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in sorted(checkpoints(folder))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(program, scope, executor, path: str) -> dict:
    """Load the checkpoint ``path`` (or the newest in a folder or run); return its progress."""
    import paddle

    found = latest(user_path(path))
    with paddle.static.scope_guard(scope):
        paddle.static.load(program, os.path.join(found, "state"), executor)
    with open(os.path.join(found, "progress.json")) as f:
        return json.load(f)


def checkpoints(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, n) for n in os.listdir(folder)
            if n.startswith("checkpoint-") and not n.endswith(".tmp")]


def latest(path: str) -> str:
    """``path`` itself if it is a checkpoint, else its newest checkpoint (or its run's)."""
    if os.path.isfile(os.path.join(path, "progress.json")):
        return path
    for folder in (path, os.path.join(path, "checkpoints")):
        found = sorted(checkpoints(folder))
        if found:
            return found[-1]
    raise ConfigError(f"resume={path}: no checkpoint found there")
