"""Checkpoints: every persistable of a program plus a progress record, written atomically.

``<folder>/checkpoint-<step>/state.pd*``, ``progress.json`` and ``config.yaml`` (the resolved
config that produced it, so a checkpoint describes itself); a checkpoint is written
under a ``.tmp`` name and renamed, so a process that dies while writing leaves the last
complete one in place.  ``resume=<run folder>`` (or a checkpoint folder) continues from
the newest.

:func:`load` reads the checkpoint and compares it with the program before anything is
loaded: no checkpoint, a file that cannot be read (truncated, damaged) or a state saved by
another model (a parameter missing, extra or of another shape) is a one-line
:class:`~kspipe.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
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


def load(program, scope, executor, path: str, key: str = "resume") -> dict:
    """Load the checkpoint ``path`` (or the newest in a folder or run); return its progress.
    ``key`` is the setting that named ``path``, for the messages.

    Raises :class:`ConfigError`, before anything is loaded, where there is no checkpoint,
    one of its files cannot be read, or its state does not fit ``program``.
    """
    import paddle

    found = latest(user_path(path), key)
    progress = read_progress(found, f"{key}={path}")
    read_state(program, os.path.join(found, "state"), f"{key}={path}")
    with paddle.static.scope_guard(scope):
        paddle.static.load(program, os.path.join(found, "state"), executor)
    return progress


def read_progress(found: str, label: str) -> dict:
    """The progress record of the checkpoint ``found`` (the setting ``label`` named it)."""
    file = os.path.join(found, "progress.json")
    try:
        with open(file) as f:
            progress = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{label}: cannot read {file}: {first_line(err)}") from err
    if not isinstance(progress, dict):
        raise ConfigError(f"{label}: {file} holds no progress record")
    return progress


def read_state(program, prefix: str, label: str) -> dict:
    """Every persistable of ``program`` as ``paddle.static.save(program, prefix)`` wrote it,
    checked to fit ``program`` (``paddle.static.load`` reads the same).

    ``<prefix>.pdparams`` must hold every parameter of ``program`` in its shape and no
    other; ``<prefix>.pdopt`` every other persistable (the optimiser's moments, the
    learning rate ...) in its shape.  Otherwise a :class:`ConfigError` ``<label>: ...``
    names the file (and the ``config.yaml`` beside it, where there is one).
    """
    from paddle.framework.io_utils import is_belong_to_optimizer, is_parameter

    variables = list(program.list_vars())
    state = {}
    for suffix, belongs, others_allowed in ((".pdparams", is_parameter, False),
                                            (".pdopt", is_belong_to_optimizer, True)):
        wanted = {var.name: tuple(var.shape) for var in variables if belongs(var)}
        file = prefix + suffix
        if not wanted and not os.path.exists(file):
            continue  # a program without optimiser state has no .pdopt
        saved = read_arrays(file, label)
        problem = misfit(saved, wanted, others_allowed)
        if problem:
            config = os.path.join(os.path.dirname(file), "config.yaml")
            seen = f" (its config: {config})" if os.path.isfile(config) else ""
            raise ConfigError(f"{label}: {file} was saved by another model: {problem}{seen}")
        state.update((name, saved[name]) for name in wanted)
    return state


def read_arrays(file: str, label: str) -> dict:
    """The arrays by name that ``paddle.static.save`` pickled into ``file``."""
    try:
        with open(file, "rb") as f:
            arrays = pickle.load(f, encoding="latin1")
    except Exception as err:  # missing, truncated, not a pickle: the same to the user
        raise ConfigError(f"{label}: cannot read {file}: "
                          f"{first_line(err) or type(err).__name__}") from err
    if not isinstance(arrays, dict):
        raise ConfigError(f"{label}: {file} holds no saved state")
    return arrays


def misfit(saved: dict, wanted: dict, others_allowed: bool) -> str:
    """Why the ``saved`` arrays do not fit the variables ``wanted`` (name: shape); '' if they do."""
    for name, shape in wanted.items():
        if name not in saved:
            return f"it has no {name}"
        have = tuple(getattr(saved[name], "shape", ()))
        if len(have) != len(shape) or any(w >= 0 and h != w for h, w in zip(have, shape)):
            return f"{name} has shape {list(have)} there, the model has {list(shape)}"
    others = sorted(set(saved) - set(wanted))
    if others and not others_allowed:
        return f"the model has no {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}"
    return ""


def first_line(err: Exception) -> str:
    """The first non-blank line of ``err``'s message ('' if none)."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), "")


def checkpoints(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, n) for n in os.listdir(folder)
            if n.startswith("checkpoint-") and not n.endswith(".tmp")]


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
