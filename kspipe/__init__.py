"""kspipe: a plugin-based workflow pipeline for distributed PaddlePaddle training.

This module holds the ``hookimpl`` marker that plugins decorate their stage implementations
with, kspipe's version, and the old names of modules that moved: importing one still works
for a minor version, with a :class:`KspipeDeprecationWarning` naming where it went.  What a
plugin author may use is in :mod:`kspipe.api`; the hook specifications live in
:mod:`kspipe.registry.hookspecs`.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

import pluggy

NAME = "kspipe"
__version__ = "0.2.0"

hookimpl = pluggy.HookimplMarker(NAME)


class KspipeDeprecationWarning(DeprecationWarning):
    """A name of kspipe that goes in its next minor version; shown by default (unless the
    interpreter was given ``-W`` options), as pytest shows its own."""


#: The version that stops answering to the old names below.
REMOVED_IN = "0.3.0"

#: Modules moved on 2026-11-27 (kspipe 0.1.0): old name -> where it went.
MOVED = {
    # into folders by concern: checkpoints, a process's life, the registry, the config
    "kspipe.incremental": "kspipe.checkpoint.incremental",
    "kspipe.resizing": "kspipe.checkpoint.resizing",
    "kspipe.checkpoint_schedule": "kspipe.checkpoint.schedule",
    "kspipe.saved_tables": "kspipe.checkpoint.tables",
    "kspipe.schema": "kspipe.config.schema",
    "kspipe.heartbeat": "kspipe.process.heartbeat",
    "kspipe.memory": "kspipe.process.memory",
    "kspipe.stopping": "kspipe.process.stopping",
    "kspipe.hookspecs": "kspipe.registry.hookspecs",
    "kspipe.plugin_manager": "kspipe.registry.plugin_manager",
    # the command, the cluster's vocabulary, the launchers, the parameter servers, MLflow
    "kspipe.plugins_cmd": "kspipe.cli.plugins",
    "kspipe.worker": "kspipe.cli.worker",
    "kspipe.endpoints": "kspipe.cluster.endpoints",
    "kspipe.modes.addresses": "kspipe.cluster.addresses",
    "kspipe.modes.meeting": "kspipe.cluster.meeting",
    "kspipe.modes.hosts": "kspipe.launchers.hosts",
    "kspipe.modes.kubernetes": "kspipe.launchers.kubernetes",
    "kspipe.modes.fleetrun": "kspipe.launchers.paddle",
    "kspipe.modes.launchers": "kspipe.launchers.processes",
    "kspipe.modes.slurm": "kspipe.launchers.slurm",
    "kspipe.modes.launch": "kspipe.launchers.watcher",
    "kspipe.modes.dense": "kspipe.modes.ps.dense",
    "kspipe.modes.exchange": "kspipe.modes.ps.exchange",
    "kspipe.modes.tables": "kspipe.modes.ps.tables",
    "kspipe.observers.recorder": "kspipe.observers.mlflow.recorder",
    "kspipe.observers.serving": "kspipe.observers.mlflow.serving",
    "kspipe.observers.store": "kspipe.observers.mlflow.store",
    "kspipe.observers.sweep_runs": "kspipe.observers.mlflow.sweep_runs",
    "kspipe.observers.tags": "kspipe.observers.mlflow.tags",
    "kspipe.observers.tracking": "kspipe.observers.mlflow.tracking",
}


class _MovedModule(importlib.abc.Loader):
    """Loads an old name as a module whose attributes are those of the module it became."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None  # a plain module; exec_module points it at the new one

    def exec_module(self, module):
        warnings.warn(
            f"{module.__name__} moved to {self.new}; the old name goes in kspipe "
            f"{REMOVED_IN}. A plugin imports what it uses from kspipe.api",
            KspipeDeprecationWarning,
            stacklevel=2,  # the importing line (the import system's own frames are skipped)
        )
        target = importlib.import_module(self.new)
        module.__doc__ = f"Moved to {self.new}."
        module.__getattr__ = lambda name: getattr(target, name)
        module.__dir__ = lambda: dir(target)


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Answers only for the old names in :data:`MOVED`, after every other finder."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModule(MOVED[fullname]))


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
if not sys.warnoptions:
    warnings.filterwarnings("default", category=KspipeDeprecationWarning)

__all__ = ["NAME", "__version__", "hookimpl", "KspipeDeprecationWarning"]
