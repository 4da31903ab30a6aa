"""Checkpoints: every persistable of a program plus a progress record, written atomically.

``<folder>/checkpoint-<step>/state.pd*``, ``progress.json``, ``config.yaml`` (the resolved
config that produced it, so a checkpoint describes itself) and, in a parameter-server job,
``tables/`` (each server's shard of every table it holds); a checkpoint is written
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

import numpy as np

from kspipe.errors import ConfigError, StorageError, first_line, storage_error
from kspipe.files import user_path

TABLES = "tables"  # a checkpoint's folder of the tables kept outside the workers
UNFINISHED = ".tmp"  # a checkpoint being written


def save(
    program, scope, folder: str, step: int, progress: dict, keep: int, cfg, tables=None
) -> str:
    """Write ``program``'s persistables in ``scope``, ``progress`` and the resolved ``cfg``;
    keep the newest ``keep``.

    ``tables(path)``, if given, writes the tables kept outside ``scope`` (the parameter
    servers' shards, :meth:`kspipe.modes.role.Role.save_tables`) into ``<checkpoint>/tables``
    before the checkpoint is complete.
    """
    from omegaconf import OmegaConf

    final = os.path.join(folder, f"checkpoint-{step:07d}")
    tmp = final + UNFINISHED
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write_state(program, scope, os.path.join(tmp, "state"))
        with open(os.path.join(tmp, "progress.json"), "w") as f:
            json.dump(progress, f)
        OmegaConf.save(cfg, os.path.join(tmp, "config.yaml"), resolve=True)
        if tables is not None:
            tables(os.path.join(tmp, TABLES))
    except BaseException as err:  # a stop request or an error mid-write: nothing half-written
        shutil.rmtree(tmp, ignore_errors=True)
        full = storage_error(err, f"writing {final}")
        if full:
            raise StorageError(f"a checkpoint could not be written: {full}") from err
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in sorted(checkpoints(folder))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(program, scope, path: str, key: str = "resume") -> dict:
    """Load the checkpoint ``path`` (or the newest in a folder or run); return its progress.
    ``key`` is the setting that named ``path``, for the messages.

    Raises :class:`ConfigError`, before anything is loaded, where there is no checkpoint,
    one of its files cannot be read, or its state does not fit ``program``.
    """
    import paddle

    found = latest(user_path(path), key)
    progress = read_progress(found, f"{key}={path}")
    state = read_state(
        program, os.path.join(found, "state"), f"{key}={path}", held_names(program, scope)
    )
    with paddle.static.scope_guard(scope):
        paddle.static.set_program_state(program, state)
    return progress


def write_state(program, scope, prefix: str) -> None:
    """What ``paddle.static.save(program, prefix)`` writes (``.pdparams``: the parameters,
    ``.pdopt``: the other persistables, ``.pdmodel``), of the variables ``scope`` holds as
    dense tensors: a table the mode keeps elsewhere (a parameter server's sparse table) is
    left to the role's ``save_tables``."""
    from paddle.framework.io_utils import is_belong_to_optimizer, is_parameter

    held = held_names(program, scope)
    for suffix, belongs in ((".pdparams", is_parameter), (".pdopt", is_belong_to_optimizer)):
        arrays = {
            var.name: np.array(scope.find_var(var.name).get_tensor())
            for var in program.list_vars()
            if belongs(var) and var.name in held
        }
        with open(prefix + suffix, "wb") as f:
            pickle.dump(arrays, f, protocol=4)
    with open(prefix + ".pdmodel", "wb") as f:
        f.write(program.desc.serialize_to_string())


def held_names(program, scope) -> set:
    """The persistables of ``program`` that ``scope`` holds as initialised dense tensors."""
    held = set()
    for var in program.list_vars():
        found = scope.find_var(var.name) if var.persistable else None
        if found is None:
            continue
        try:
            if found.get_tensor()._is_initialized():
                held.add(var.name)
        except (ValueError, RuntimeError):  # another kind of variable (SelectedRows ...)
            pass
    return held


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


def read_state(program, prefix: str, label: str, names: set | None = None) -> dict:
    """Every persistable of ``program`` (or those of ``names``) as
    ``paddle.static.save(program, prefix)`` or :func:`write_state` wrote it, checked to fit
    ``program``.

    ``<prefix>.pdparams`` must hold every parameter of ``program`` in its shape and no
    other; ``<prefix>.pdopt`` every other persistable (the optimiser's moments, the
    learning rate ...) in its shape.  Otherwise a :class:`ConfigError` ``<label>: ...``
    names the file (and the ``config.yaml`` beside it, where there is one).
    """
    from paddle.framework.io_utils import is_belong_to_optimizer, is_parameter

    variables = [var for var in program.list_vars() if names is None or var.name in names]
    state = {}
    for suffix, belongs, others_allowed in (
        (".pdparams", is_parameter, False),
        (".pdopt", is_belong_to_optimizer, True),
    ):
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
        raise ConfigError(
            f"{label}: cannot read {file}: {first_line(err) or type(err).__name__}"
        ) from err
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
