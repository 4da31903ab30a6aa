"""The config's schema: the top-level keys, ``compile``, ``stages`` and ``tracking``, and the
registration of every group's dataclass in Hydra's ConfigStore.

``conf/config.yaml`` lists one option of each group in its defaults list; each option is a
dataclass stored here, or one a built-in plugin declares with ``kspipe_config_schemas`` as
installed plugins declare theirs (in ``kspipe/<owner>/config.py``, the option ``<owner>``).
Hydra merges a typed node under each key, so inside a group a misspelt key or a value of the
wrong type is refused while the config is composed.  The root itself stays an open mapping
(:func:`open_root`): a plugin's experiment may add a top-level key of its own (``shapes:``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

#: ``${kspipe_min:a,b}``, the smaller of two values: a default that follows another key up
#: to a bound (``eval.train_tasks``: ``${kspipe_min:${.tasks},20}``, as ``eval.tasks``, at
#: most 20), which a value given for the key itself replaces.
MIN_RESOLVER = "kspipe_min"


@dataclass
class CoreConfig:
    """The top-level keys.  ``workers``/``servers`` are a count or a ``host:port,...`` list and
    ``devices`` is null, a count, a string or a list, so their types are checked by the modes."""

    mode: str = "local"  # local | pserver | collective: how many processes and how they meet
    workers: Any = 1  # worker processes, or a host:port list (across machines)
    servers: Any = 1  # parameter servers for mode=pserver, or a host:port list
    devices: Any = None  # mode=collective on a GPU build: GPU ids ("0,1"); null: all visible
    seed: int = 0  # seeds data splits, task sampling and weights
    resume: Optional[str] = None  # a run folder or checkpoint folder to continue from
    evaluate: Optional[str] = None  # a run folder or checkpoint: evaluate it, no training
    init_from: Optional[str] = None  # a run folder or checkpoint: a new run starts from its
    #                                  model (parameters only), in any mode
    run_dir: Optional[str] = None  # where the run writes files; default: Hydra's output folder
    isolate: Optional[bool] = None  # mode=local: run the job in a child process;
    #                                 null: only in a sweep (-m)


@dataclass
class CompileConfig:
    """How programs are compiled before they run."""

    onednn_conv: bool = True  # convolutions on oneDNN's CPU kernels (about 2x faster on CPU)
    # BuildStrategy options applied through CompiledProgram, e.g.
    # {fuse_elewise_add_act_ops: true, debug_graphviz_path: graph/program}
    build_strategy: Dict[str, Any] = field(default_factory=dict)
    # {num_threads: N}; the Fluid era's other options are refused
    execution_strategy: Dict[str, Any] = field(default_factory=dict)


@dataclass
class StagesConfig:
    """Which plugin serves each stage (see ``kspipe plugins``)."""

    role: str = "${mode}"  # the mode: roles, launch, how training is distributed
    dataset: str = "open_ks"
    program: str = "reptile"  # the workload: it serves compile, execute and save too
    compile: str = "${.program}"
    execute: str = "${.program}"
    save: str = "${.program}"


@dataclass
class TrackingConfig:
    """The MLflow record of a run."""

    enabled: bool = True
    uri: Optional[str] = None  # default sqlite:///<working folder>/mlflow.db
    experiment: str = "kspipe"
    run_name: Optional[str] = None
    model: bool = True  # log the run's inference model as an MLflow model (a pyfunc)
    register: Optional[str] = None  # also register the run's MLflow model under this name
    alias: Optional[str] = None  # with register: that version is models:/<register>@<alias>
    # each process's CPU, memory and network in the run (system/worker0/...), sampled by
    # its recorder process every system_metrics_interval seconds
    system_metrics: bool = True
    system_metrics_interval: float = 10.0
    # the MLflow run a cluster job's processes record into: the command that starts them
    # sets it in their job.yaml (its first worker records there)
    run_id: Optional[str] = None


def register_schemas(plugins: dict | None = None) -> None:
    """Store every group's schema in Hydra's ConfigStore; call it before Hydra composes.

    Storing again replaces each entry, so calling it twice is harmless.  kspipe's own groups
    are those the built-in plugins declare with ``kspipe_config_schemas``
    (:func:`builtin_schemas`), each stored as the option that ``conf/config.yaml``'s defaults
    list names (:func:`option_name`).  ``plugins``: ``{group: dataclass}`` (or ``{group:
    [dataclass, ...]}``, :func:`joined`) of the installed plugins' groups
    (:func:`kspipe.registry.plugin_manager.plugin_schemas`), stored together as the config
    ``plugins``, which the defaults list merges right after the top-level keys.
    """
    from hydra.core.config_store import ConfigStore

    from kspipe.job import register_resolver

    register_resolver()  # hydra.run.dir's
    register_min_resolver()
    store = ConfigStore.instance()
    store.store(name="core", node=open_root(CoreConfig))
    for group, schema in (
        ("compile", CompileConfig),
        ("stages", StagesConfig),
        ("tracking", TrackingConfig),
    ):
        store.store(group=group, name="core", node=schema)
    for group, parts in builtin_schemas().items():
        store.store(group=group, name=option_name(parts[0]), node=joined(group, parts))
    groups = {name for name in store.list("") if not name.endswith(".yaml")}
    store.store(name="plugins", node=plugin_groups(plugins or {}, groups))


def register_min_resolver() -> None:
    """Make ``${kspipe_min:a,b}`` (:data:`MIN_RESOLVER`) known to OmegaConf: the defaults
    use it, so every process that reads a composed config registers it first (a job
    process Hydra's launcher started too, :class:`kspipe.cli.jobs.Jobs`)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(MIN_RESOLVER, min, replace=True)


def builtin_schemas() -> dict:
    """``{group: [dataclass, ...]}`` of kspipe's own groups: what the built-in plugins declare
    with ``kspipe_config_schemas``, as installed plugins declare theirs."""
    from kspipe.registry.plugin_manager import get_plugin_manager, plugin_schemas

    return plugin_schemas(get_plugin_manager(load_entrypoints=False), builtin=True)


def option_name(schema: type) -> str:
    """The option a built-in group is stored as, which the defaults list names: the package
    of the module that declares its (first) dataclass, ``dataset: fewshot`` for
    :class:`kspipe.fewshot.config.DatasetConfig`."""
    return schema.__module__.split(".")[1]


def joined(group: str, parts) -> type:
    """``group``'s one dataclass: ``parts`` if it is a dataclass; if it is a list of them,
    what several plugins declared, in the order they were registered, one with the keys of
    each in that order.  A key two of them declare is one line."""
    import dataclasses

    from kspipe.errors import ConfigError

    if isinstance(parts, type):
        return parts
    if len(parts) == 1:
        return parts[0]
    owners: dict = {}
    for part in parts:
        for key in (each.name for each in dataclasses.fields(part)):
            if key in owners:
                raise ConfigError(
                    f"two plugins declare the key {group}.{key} of their config "
                    f"group ({owners[key].__qualname__} and {part.__qualname__})"
                )
            owners[key] = part
    names = ", ".join(part.__qualname__ for part in parts)
    # a dataclass has its bases' fields, the last base's first
    return dataclasses.make_dataclass(
        f"{group.capitalize()}Config",
        [],
        bases=tuple(reversed(parts)),
        namespace={"__doc__": f"The {group} group: {names}."},
    )


def plugin_groups(schemas: dict, groups: set):
    """The plugins' groups as one open mapping, each a typed node of its dataclass
    (:func:`joined`); a group named as one of kspipe's own ``groups`` or top-level keys is
    one line."""
    from omegaconf import OmegaConf

    from kspipe.errors import ConfigError

    taken = sorted((groups | set(OmegaConf.structured(CoreConfig))) & set(schemas))
    if taken:
        raise ConfigError(f"a plugin declares the config group {taken[0]!r}, which is kspipe's own")
    root = OmegaConf.create()
    for group, parts in sorted(schemas.items()):
        root[group] = OmegaConf.structured(joined(group, parts))
    return root


def open_root(schema):
    """``schema``'s fields as a plain mapping of typed values.

    Merged into a plain root, a dataclass would make the whole root typed and refuse keys it
    does not name, such as a plugin's own group; this keeps each field's type check (and the
    nested dataclasses' own) while the root accepts new keys.
    """
    from omegaconf import OmegaConf

    typed = OmegaConf.structured(schema)
    root = OmegaConf.create()
    for key in typed:
        root[key] = typed._get_node(key)
    return root
