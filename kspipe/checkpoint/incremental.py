"""Incremental training: a new run that starts from the model a finished run saved
(``init_from=<run folder, checkpoint or save_persistables folder>``), in any mode.

What a run saved is read as one model whatever its mode wrote: the parameters the workers
held (a checkpoint's ``state.pdparams``, or the ``persistables.pdparams`` of OpenKS's
``save_persistables``) and the rows of the parameter servers' sparse tables (its
``tables/`` folder).  The new run's program takes them where its own mode keeps them: a
parameter the workers hold is set in the scope before ``role.init_worker`` (whose first
worker's values become the job's), a table on this job's servers gets its rows afterwards.
The optimiser's state the workers held (moments, accumulators: Reptile's inner Adam, which
every task adapts with) carries over where the new program has it in the same shape; the
rest of it starts afresh (a sparse table's rows on the servers always do), and so does the
progress (epochs, meta-iterations).  ``resume=`` continues one run with everything.

A source of another workload, or whose parameters do not fit the program (missing, extra,
another shape), is a one-line :class:`~kspipe.errors.ConfigError` before anything trains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from kspipe import checkpoint
from kspipe.checkpoint.tables import read_table_rows
from kspipe.contracts import Role
from kspipe.errors import ConfigError
from kspipe.files import user_path

#: The folder OpenKS's ``save_persistables(exe, dir)`` writes ``persistables.pd*`` into.
PERSISTABLES = "persistables"


@dataclass
class SavedModel:
    """A model as a run saved it: ``dense`` parameters by name and sparse ``tables`` by
    name as (ids, rows); ``where``: the file the dense ones came from."""

    where: str
    dense: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    workload: str | None = None
    optimizer: dict = field(default_factory=dict)  # the optimiser's state the workers held


@dataclass
class Start:
    """What :func:`start_from` left for the mode: rows for tables the workers do not hold."""

    rows: dict = field(default_factory=dict)
    folder: str = ""

    def load_tables(self, role: Role) -> None:
        """Every worker, after ``role.init_worker``: the servers' tables get their rows."""
        role.load_table_rows(self.rows, self.folder)


def check_source(cfg, key: str = "init_from") -> None:
    """Before any process starts: one line for an ``init_from`` that names no saved model,
    a model of another workload, or that comes with ``resume`` or ``evaluate``."""
    path = cfg.get(key)
    if not path:
        return
    for other in ("resume", "evaluate"):
        if cfg.get(other):
            raise ConfigError(
                f"{key}= starts a new run from a saved model, {other}= "
                f"continues or evaluates one: give one of them"
            )
    workload = saved_workload(os.path.dirname(state_prefix(path, key)))
    if workload and workload != cfg.stages.program:
        raise ConfigError(
            f"{key}={path}: saved by the {workload} workload, this run is {cfg.stages.program}"
        )


def saved_workload(found: str) -> str | None:
    """The workload whose run wrote the checkpoint ``found`` (None: not recorded)."""
    from omegaconf import OmegaConf

    config = os.path.join(found, "config.yaml")
    if not os.path.isfile(config):
        return None
    return OmegaConf.load(config).get("stages", {}).get("program")


def state_prefix(path: str, key: str = "init_from") -> str:
    """Where the saved state of ``path`` is, as ``paddle.static.save`` names it: a
    ``save_persistables`` folder's ``persistables``, else the newest checkpoint's ``state``."""
    folder = user_path(path)
    if os.path.isfile(os.path.join(folder, PERSISTABLES + ".pdparams")):
        return os.path.join(folder, PERSISTABLES)
    return os.path.join(checkpoint.latest(folder, key), "state")


def read_saved(path: str, key: str = "init_from") -> SavedModel:
    """The model saved at ``path``: a ``save_persistables`` folder, a checkpoint, or a run
    folder (its newest checkpoint)."""
    label = f"{key}={path}"
    prefix = state_prefix(path, key)
    found = os.path.dirname(prefix)
    model = SavedModel(
        prefix + ".pdparams",
        checkpoint.read_arrays(prefix + ".pdparams", label),
        workload=saved_workload(found),
    )
    if os.path.isfile(prefix + ".pdopt"):
        model.optimizer = checkpoint.read_arrays(prefix + ".pdopt", label)
    tables = os.path.join(found, checkpoint.TABLES)
    if os.path.isdir(tables):
        model.tables = read_table_rows(tables)
    return model


def start_from(cfg, program, scope, run_dir: str, reporter=None, key: str = "init_from"):
    """Before ``role.init_worker``, after the startup program: the parameters of
    ``program`` that ``scope`` holds take their values from ``cfg.init_from``; returns the
    :class:`Start` whose ``load_tables(role)`` gives the mode's tables theirs after
    ``init_worker`` (nothing when ``init_from`` is not set)."""
    import paddle
    from paddle.framework.io_utils import is_parameter

    path = cfg.get(key)
    if not path:
        return Start()
    check_source(cfg, key)
    model = read_saved(path, key)
    label = f"{key}={path}"
    wanted = {var.name: tuple(var.shape) for var in program.list_vars() if is_parameter(var)}
    holds = checkpoint.held_names(program, scope)
    held = holds & set(wanted)
    extra = sorted((set(model.dense) | set(model.tables)) - set(wanted))
    if extra:
        raise ConfigError(
            f"{label}: {model.where} was saved by another model: the model has "
            f"no {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
        )
    values, rows = {}, {}
    carried = optimizer_state(program, holds, model.optimizer)
    for name, shape in sorted(wanted.items()):
        if name in model.dense:
            value = np.asarray(model.dense[name])
            fits(label, model.where, name, value.shape, shape)
            if name in held:
                values[name] = value
            else:  # the job keeps it on its servers: every row of it
                rows[name] = (np.arange(value.shape[0], dtype=np.int64), value)
        elif name in model.tables:
            ids, saved_rows = model.tables[name]
            fits(label, model.where, name, (None,) + saved_rows.shape[1:], shape)
            if name in held:
                values[name] = with_rows(
                    np.array(scope.find_var(name).get_tensor()), ids, saved_rows, label, name
                )
            else:
                rows[name] = (ids, saved_rows)
        else:
            raise ConfigError(
                f"{label}: {model.where} was saved by another model: it has no {name}"
            )
    for name, value in {**values, **carried}.items():
        tensor = scope.find_var(name).get_tensor()
        tensor.set(np.asarray(value).astype(np.array(tensor).dtype), paddle.CPUPlace())
    if reporter is not None:
        state = f"{len(carried)} of the optimiser's variables" if carried else "none"
        reporter.say(
            f"starting from the model in {os.path.dirname(model.where)}: "
            f"{len(values) + len(rows)} parameters, the optimiser's state: {state}"
        )
    return Start(rows, os.path.join(run_dir, "init_from"))


def optimizer_state(program, held: set, saved: dict) -> dict:
    """The optimiser's variables of ``program`` the workers hold that ``saved`` has in
    the same shape (moments, accumulators, schedules: the rest start afresh)."""
    from paddle.framework.io_utils import is_belong_to_optimizer

    carried = {}
    for var in program.list_vars():
        if var.name in held and is_belong_to_optimizer(var) and var.name in saved:
            value = np.asarray(saved[var.name])
            if value.shape == tuple(var.shape):
                carried[var.name] = value
    return carried


def fits(label: str, where: str, name: str, have: tuple, shape: tuple) -> None:
    """One line unless a saved ``have`` shape (None: any rows) fits the variable's."""
    if len(have) != len(shape) or any(
        h is not None and w >= 0 and h != w for h, w in zip(have, shape)
    ):
        shown = ["any" if h is None else h for h in have]
        raise ConfigError(
            f"{label}: {where} was saved by another model: {name} has shape "
            f"{shown} there, the model has {list(shape)}"
        )


def with_rows(
    value: np.ndarray, ids: np.ndarray, rows: np.ndarray, label: str, name: str
) -> np.ndarray:
    """``value`` (a table's rows as the startup made them) with rows ``ids`` set."""
    if len(ids) and (ids.min() < 0 or ids.max() >= value.shape[0]):
        raise ConfigError(
            f"{label}: table {name} holds id {int(ids.max())}, the model's table "
            f"has {value.shape[0]} rows"
        )
    value = value.copy()
    value[ids] = rows
    return value
