"""The config's schema: the top-level keys, ``compile``, ``stages`` and ``tracking``, and the
registration of every group's dataclass in Hydra's ConfigStore.

``conf/config.yaml`` lists one option of each group in its defaults list; each option is a
dataclass stored here or by the module that owns the group (``kspipe/<owner>/config.py``).
Hydra merges a typed node under each key, so inside a group a misspelt key or a value of the
wrong type is refused while the config is composed.  The root itself stays an open mapping
(:func:`open_root`): a plugin's experiment may add a top-level key of its own (``shapes:``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

@dataclass
class CoreConfig:
    """The top-level keys.  ``workers``/``servers`` are a count or a ``host:port,...`` list and
    ``devices`` is null, a count, a string or a list, so their types are checked by the modes."""

    mode: str = "local"      # local | pserver | collective: how many processes and how they meet
    workers: Any = 1         # worker processes, or a host:port list (across machines)
    servers: Any = 1         # parameter servers for mode=pserver, or a host:port list
    devices: Any = None      # mode=collective on a GPU build: GPU ids ("0,1"); null: all visible
    seed: int = 0            # seeds data splits, task sampling and weights
    resume: Optional[str] = None   # a run folder or checkpoint folder to continue from
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

    role: str = "${mode}"     # the mode: roles, launch, how training is distributed
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


def register_schemas(plugins: dict | None = None) -> None:
    """Store every group's schema in Hydra's ConfigStore; call it before Hydra composes.

    Storing again replaces each entry, so calling it twice is harmless.  Like
    :func:`kspipe.plugin_manager.builtin_plugins`, this is where the core names the
    built-in plugins' modules: each ``kspipe/<owner>/config.py`` stores its own groups.
    ``plugins``: ``{group: dataclass}`` of the installed plugins' own groups
    (:func:`kspipe.plugin_manager.plugin_schemas`), stored together as the config
    ``plugins``, which the defaults list merges right after the top-level keys.
    """
    from hydra.core.config_store import ConfigStore

    from kspipe.ctr import config as ctr
    from kspipe.datafeed import config as datafeed
    from kspipe.fewshot import config as fewshot
    from kspipe.modes import config as modes
    from kspipe.reptile import config as reptile

    from kspipe.job import register_resolver

    register_resolver()  # hydra.run.dir's
    store = ConfigStore.instance()
    store.store(name="core", node=open_root(CoreConfig))
    for group, schema in (("compile", CompileConfig), ("stages", StagesConfig),
                          ("tracking", TrackingConfig)):
        store.store(group=group, name="core", node=schema)
    for owner in (fewshot, reptile, datafeed, ctr, modes):
        owner.register(store)
    groups = {name for name in store.list("") if not name.endswith(".yaml")}
    store.store(name="plugins", node=plugin_groups(plugins or {}, groups))


def plugin_groups(schemas: dict, groups: set):
    """The plugins' groups as one open mapping, each a typed node of its dataclass; a
    group named as one of kspipe's own ``groups`` or top-level keys is one line."""
    from omegaconf import OmegaConf

    from kspipe.errors import ConfigError

    taken = sorted((groups | set(OmegaConf.structured(CoreConfig))) & set(schemas))
    if taken:
        raise ConfigError(f"a plugin declares the config group {taken[0]!r}, which is "
                          f"kspipe's own")
    root = OmegaConf.create()
    for group, schema in sorted(schemas.items()):
        root[group] = OmegaConf.structured(schema)
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
