"""The registry: hook specs, built-in plugins, then installed ones, then a check for typos;
and what it holds (the plugins serving a stage, the installed packages, their schemas).

How a run uses it (a stage's one plugin, the workload, the process launcher) is the
spine's business: :mod:`kspipe.pipeline`.
"""

from __future__ import annotations

import os

import pluggy

from kspipe import NAME
from kspipe.errors import ConfigError
from kspipe.registry import hookspecs

#: Stage name (the key under ``stages:`` in the config) to the hook that serves it.
STAGES = {
    "role": "kspipe_assign_role",
    "dataset": "kspipe_read_dataset",
    "program": "kspipe_build_program",
    "compile": "kspipe_compile_program",
    "execute": "kspipe_execute",
    "save": "kspipe_save_inference_model",
}

#: Set to 1 to skip plugins installed under the ``kspipe`` entry-point group.
DISABLE_AUTOLOAD_ENV = "KSPIPE_DISABLE_PLUGIN_AUTOLOAD"


def builtin_plugins():
    """Return ``(name, plugin)`` of the plugins that ship inside kspipe: modes, data sets,
    workloads, observers."""
    from kspipe.ctr import plugin as ctr
    from kspipe.datafeed import plugin as datafeed
    from kspipe.fewshot import plugin as open_ks
    from kspipe.launchers import kubernetes, paddle, processes, slurm
    from kspipe.modes import collective, local, pserver
    from kspipe.observers import progress
    from kspipe.observers.mlflow import tracking
    from kspipe.reptile import plugin as reptile

    return [
        ("local", local),
        ("pserver", pserver),
        ("collective", collective),
        ("processes", processes),
        ("slurm", slurm),
        ("paddlejob", kubernetes),
        ("paddle", paddle),
        ("open_ks", open_ks),
        ("reptile", reptile),
        ("datafeed", datafeed),
        ("ctr", ctr),
        ("progress", progress.ProgressLine()),
        ("mlflow", tracking.MlflowTracker()),
    ]


def get_plugin_manager(load_entrypoints: bool | None = None) -> pluggy.PluginManager:
    """Build the registry: hook specs, built-in plugins, installed plugins, typo check.

    :param load_entrypoints: load plugins of the ``kspipe`` entry-point group; by default
        yes unless the environment variable ``KSPIPE_DISABLE_PLUGIN_AUTOLOAD`` is set.
    """
    pm = pluggy.PluginManager(NAME)
    pm.add_hookspecs(hookspecs)
    for name, plugin in builtin_plugins():
        pm.register(plugin, name=name)
    if load_entrypoints is None:
        load_entrypoints = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    if load_entrypoints:
        load_installed(pm)
    pm.check_pending()
    return pm


def load_installed(pm: pluggy.PluginManager) -> None:
    """Register the plugins of the ``kspipe`` entry-point group.

    One whose name is taken (a built-in's, or an earlier package's) is not loaded, and a
    warning says so: pluggy's own loading would skip it silently.
    """
    for dist, ep in entry_points():
        if pm.is_blocked(ep.name):
            continue
        taken = pm.get_plugin(ep.name)
        if taken is not None:
            if getattr(taken, "__name__", None) != ep.value:  # not this same module again
                warn_collision(ep.name, dist.metadata["name"])
            continue
        pm.register(ep.load(), name=ep.name)


def entry_points() -> list:
    """``[(distribution, entry point)]`` of the ``kspipe`` group, in the order they load."""
    from importlib import metadata

    return [
        (dist, ep)
        for dist in metadata.distributions()
        for ep in dist.entry_points
        if ep.group == NAME
    ]


def installed_packages() -> dict:
    """``{plugin name: "package version"}`` of the plugins :func:`load_installed` loads (the
    first of a name that no built-in has)."""
    builtin = {name for name, _ in builtin_plugins()}
    packages = {}
    for dist, ep in entry_points():
        if ep.name not in builtin and ep.name not in packages:
            packages[ep.name] = f"{dist.metadata['name']} {dist.version}"
    return packages


def warn_collision(name: str, package: str) -> None:
    from kspipe.reporting import say

    say(
        f"warning: the installed plugin {name!r} of {package} is not loaded: a built-in "
        f"or earlier plugin has that name; rename its entry point"
    )


def implementers(pm: pluggy.PluginManager, stage: str) -> list[str]:
    """Names of the registered plugins that implement ``stage``, sorted."""
    hook = getattr(pm.hook, STAGES[stage])
    return sorted(pm.get_name(impl.plugin) for impl in hook.get_hookimpls())


def plugin_schemas(pm: pluggy.PluginManager, builtin: bool = False) -> dict:
    """``{group: [dataclass, ...]}`` that the installed plugins declare with
    ``kspipe_config_schemas`` (``builtin``: that the built-in ones declare, kspipe's own
    groups), each group's in the order the plugins were registered; a dataclass several
    return counts once.  One that is not a dataclass is one line.  Several of one group are
    one dataclass of all their keys (:func:`kspipe.config.schema.joined`)."""
    import dataclasses

    names = {name for name, _ in builtin_plugins()}
    schemas: dict = {}
    for impl in pm.hook.kspipe_config_schemas.get_hookimpls():
        if (impl.plugin_name in names) != builtin:
            continue
        for group, schema in (impl.function() or {}).items():
            if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
                raise ConfigError(
                    f"a plugin's schema for the config group {group!r} is not a "
                    f"dataclass ({schema!r})"
                )
            if schema not in schemas.setdefault(group, []):
                schemas[group].append(schema)
    return schemas
