"""Checkpoints: every persistable of a program plus a progress record, written atomically.

``<folder>/checkpoint-<step>/state.pd*``, ``progress.json``, ``config.yaml`` (the resolved
config that produced it, so a checkpoint describes itself) and, in a parameter-server job,
``tables/`` (each server's shard of every table it holds); a checkpoint is written
under a ``.tmp`` name and renamed, so a process that dies while writing leaves the last
complete one in place.  ``resume=<run folder>`` (or a checkpoint folder) continues from
the newest.  With a :class:`Writer`, training waits only while the state is copied; the
files are written on the writer's thread.

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
import threading
from contextlib import contextmanager, suppress

import numpy as np

from kspipe.checkpoint.folders import (  # noqa: F401 (kspipe.checkpoint.<name>)
    UNFINISHED,
    checkpoints,
    discard_unfinished,
    latest,
    stale,
)
from kspipe.errors import ConfigError, StorageError, first_line, storage_error
from kspipe.files import user_path
from kspipe.process import heartbeat
from kspipe.reporting import check_parameters

TABLES = "tables"  # a checkpoint's folder of the tables kept outside the workers


def save(
    program,
    scope,
    folder: str,
    step: int,
    progress: dict,
    keep: int,
    cfg,
    tables=None,
    writer: Writer | None = None,
    follows: str | None = None,
) -> str:
    """Write ``program``'s persistables in ``scope``, ``progress`` and the resolved ``cfg``;
    keep the newest ``keep``.  Returns the checkpoint's path.  A parameter that is NaN or
    infinite is a :class:`~kspipe.errors.NonFiniteError` naming it, and nothing is written.

    ``follows``: the folder of the checkpoints this one is a part of (a worker's own state
    beside the first worker's checkpoint): it keeps a part for as long as that folder may
    resume from it (see :func:`stale`), not ``keep`` of its own.

    ``tables(path)``, if given, writes the tables kept outside ``scope`` (the parameter
    servers' shards, :meth:`kspipe.modes.role.Role.save_tables`) into ``<checkpoint>/tables``
    before the checkpoint is complete.

    With a :class:`Writer`, training waits only while the state is copied (and the servers
    write their tables: they hold them, and the next step would change them); the files
    are written, renamed into place and the old checkpoints removed on the writer's
    thread.  The checkpoint is then complete once :meth:`Writer.wait` returns.
    """
    from omegaconf import OmegaConf

    final = os.path.join(folder, f"checkpoint-{step:07d}")
    tmp = final + UNFINISHED
    if writer is not None:
        writer.wait()  # one write at a time; an earlier write's error surfaces here
    shutil.rmtree(tmp, ignore_errors=True)
    with _written(tmp, final), heartbeat.phase("writing a checkpoint"):
        os.makedirs(tmp)
        if tables is not None:
            tables(os.path.join(tmp, TABLES))
        if writer is None:
            state, config = copy_state(program, scope), OmegaConf.to_yaml(cfg, resolve=True)
        else:
            state, config = copy_state(program, scope, writer.layout(program)), writer.config(cfg)
        check_parameters(state[".pdparams"], f"at the checkpoint of step {step} (not written)")

    def write() -> None:
        with _written(tmp, final):
            write_copied(state, os.path.join(tmp, "state"))
            with open(os.path.join(tmp, "progress.json"), "w") as f:
                json.dump(progress, f)
            with open(os.path.join(tmp, "config.yaml"), "w") as f:
                f.write(config)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in stale(folder, keep, follows):
            shutil.rmtree(old, ignore_errors=True)

    if writer is None:
        write()
    else:
        writer.start(write)
    return final


@contextmanager
def _written(tmp: str, final: str):
    """Part of writing the checkpoint ``final`` in ``tmp``: on a stop request or an error,
    nothing half-written is left, and a full or read-only disk is a :class:`StorageError`."""
    try:
        yield
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        full = storage_error(err, f"writing {final}")
        if full:
            raise StorageError(f"a checkpoint could not be written: {full}") from err
        raise


class Writer:
    """Writes checkpoints on a thread of its own, one at a time, so training goes on while
    the files are written (:func:`save` with ``writer=``).

    Measured (BENCHMARKS.md, ``bench/bench_checkpoint.py``): a Reptile checkpoint of
    0.35-5.4 MB written on the training thread stopped it for 37-93 ms, of which copying
    the state was 5-26 ms; the rest was the files and what a writer keeps from the first
    checkpoint on (the resolved config, the serialised program).  Training now waits for
    the copy alone.  Why it stays safe:

    * at most one write is in flight: :func:`save` waits for the last one before it copies,
      so two writes never race over the same folder or the removal of old checkpoints;
    * the thread is not a daemon: Python waits for it before the process exits, at the end
      of a run and when a stop request (SIGTERM, Ctrl-C) unwinds it, so the last
      checkpoint is complete; a process killed outright leaves only a ``.tmp`` folder,
      and the checkpoint before stays the newest complete one;
    * an error in the write (a full disk) is kept and raised in the training thread at
      the next :meth:`check`, :func:`save` or :meth:`wait`: the job's one-line error.
    """

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._kept: dict = {}  # id: (object, what of it stays the same while it trains)

    def layout(self, program) -> dict:
        """:func:`state_layout` of ``program``, made at its first checkpoint."""
        return self._keep(program, state_layout)

    def config(self, cfg) -> str:
        """The resolved ``cfg`` as YAML, made at the first checkpoint (a run's config does
        not change while it trains; resolving it costs tens of milliseconds)."""
        from omegaconf import OmegaConf

        return self._keep(cfg, lambda c: OmegaConf.to_yaml(c, resolve=True))

    def _keep(self, thing, make):
        kept = self._kept.get(id(thing))
        if kept is None or kept[0] is not thing:
            kept = self._kept[id(thing)] = (thing, make(thing))
        return kept[1]

    def start(self, write) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="kspipe-checkpoint")
        self._thread.start()

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as err:  # raised in the training thread (wait)
            self._error = err

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the error of a write that has ended, without waiting for one under way."""
        if not self.busy():
            self.wait()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace) -> None:
        """The last checkpoint is complete when the block ends, however it ends; the
        write's error is raised unless another is on its way out already."""
        if kind is None:
            self.wait()
            return
        with suppress(Exception):
            self.wait()

    def wait(self) -> None:
        """Return once the write under way, if any, is complete; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


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
    write_copied(copy_state(program, scope), prefix)


def copy_state(program, scope, layout: dict | None = None) -> dict:
    """What :func:`write_state` writes, copied out of ``scope`` (training may go on):
    ``{".pdparams": arrays, ".pdopt": arrays, ".pdmodel": the program's bytes}``.
    ``layout``: :func:`state_layout` of ``program``, if known."""
    layout = layout or state_layout(program)
    state = {".pdmodel": layout[".pdmodel"]}
    for suffix in (".pdparams", ".pdopt"):
        state[suffix] = {}
        for name in layout[suffix]:
            tensor = dense_tensor(scope, name)
            if tensor is not None:
                state[suffix][name] = np.array(tensor)
    return state


def state_layout(program) -> dict:
    """What of ``program`` a checkpoint holds: the persistables' names by file
    (``.pdparams``: the parameters, ``.pdopt``: the other persistables) and ``.pdmodel``,
    the program's bytes.  It stays the same while a program trains, and costs more than
    copying a small model's state (the program's serialisation, its variables' names):
    a :class:`Writer` keeps it."""
    from paddle.framework.io_utils import is_belong_to_optimizer, is_parameter

    variables = [var for var in program.list_vars() if var.persistable]
    return {
        ".pdparams": [var.name for var in variables if is_parameter(var)],
        ".pdopt": [var.name for var in variables if is_belong_to_optimizer(var)],
        ".pdmodel": program.desc.serialize_to_string(),
    }


def dense_tensor(scope, name: str):
    """The initialised dense tensor ``scope`` holds as ``name``, else None."""
    found = scope.find_var(name)
    if found is None:
        return None
    try:
        tensor = found.get_tensor()
        return tensor if tensor._is_initialized() else None
    except (ValueError, RuntimeError):  # another kind of variable (SelectedRows ...)
        return None


def write_copied(state: dict, prefix: str) -> None:
    """The files of :func:`copy_state`'s ``state`` at ``prefix``."""
    for suffix, content in state.items():
        with open(prefix + suffix, "wb") as f:
            if isinstance(content, bytes):
                f.write(content)
            else:
                pickle.dump(content, f, protocol=4)


def held_names(program, scope) -> set:
    """The persistables of ``program`` that ``scope`` holds as initialised dense tensors."""
    return {
        var.name
        for var in program.list_vars()
        if var.persistable and dense_tensor(scope, var.name) is not None
    }


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
