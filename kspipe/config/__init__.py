"""Composing the config, and the checks every run needs whatever its workload and mode.

Types and known keys are the schema's (:mod:`kspipe.config.schema`): Hydra refuses a mistake while
it composes, and :func:`compose` says which ``key=value`` in one line.  Ranges are each
workload's and mode's ``kspipe_check_config``, helped by :func:`kspipe.errors.check_keys`.
"""

from __future__ import annotations

import dataclasses
import difflib

from kspipe.errors import ConfigError, check_integer, first_line


def compose(overrides=(), config_dirs=(), schemas=None):
    """The config ``kspipe <overrides>`` would run, composed without starting a job.

    ``config_dirs`` are more config folders (``pkg://...``) and ``schemas`` the config
    groups' dataclasses (``{group: dataclass}``), as plugins add.  A value of the wrong
    type, a key no schema knows or an unknown option raises :class:`ConfigError`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from kspipe.config.schema import register_schemas

    register_schemas(schemas)
    overrides = list(overrides)
    if config_dirs:
        overrides.append(f"hydra.searchpath=[{','.join(config_dirs)}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(version_base="1.3", config_module="kspipe.conf"):
            cfg = hydra_compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(explain(err, overrides)) from None
    check_schema_keys(cfg, overrides)
    check_key_names(cfg, overrides)
    return cfg


def explain(err: Exception, overrides: list[str]) -> str:
    """One line for a composition error: ``<key>=<value>: <reason>`` where a key is known."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, OverrideParseException):
        return f"{err.override}: cannot read it ({first_line(err)})"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, name = err.missing_cfg_file.rpartition("/")
        options = ", ".join(err.options or ())
        return f"{group}={name}: no such option of {group} (available: {options})"
    text = str(err)
    if text.startswith("Ambiguous value for argument '"):
        override = text.split("'")[1]
        return (
            f"{override}: several values are a sweep, which needs -m "
            "(a list is [a,b]; a string with commas is quoted)"
        )
    cause = err if hasattr(err, "full_key") else (err.__cause__ or err.__context__)
    full_key = getattr(cause, "full_key", None)
    if not full_key:
        return first_line(err)
    if text.startswith("In '"):  # a value of a config file, such as an experiment
        value, where = getattr(cause, "value", None), text.split("'")[1]
        shown = full_key if value is None else f"{full_key}={value}"
        return f"{shown}: {reason(cause)} (in {where})"
    override = hydra_override(text) or given(overrides, full_key) or full_key
    said = reason(cause, override)
    key = override.lstrip("+~").partition("=")[0]
    if full_key.startswith((key + ".", key + "[")) and said.startswith("must"):
        said = f"{full_key} {said}"  # an item of the value given: ctr.hidden[1] must be ...
    return f"{override}: {said}"


def reason(cause, override: str = "") -> str:
    """What an OmegaConf error means, said as what the value must be."""
    message = first_line(cause)
    if "converted to Integer" in message:
        return "must be an integer"
    if "converted to Float" in message:
        return "must be a number"
    if "is not a valid bool" in message:
        return "must be true or false"
    if "is not Optional" in message or "non-optional" in message.lower():
        return "must not be null"
    schema = getattr(cause, "object_type", None)
    if message.startswith("Key ") and dataclasses.is_dataclass(schema):
        return unknown_key(cause.full_key, schema)
    if "not in struct" in message:
        return f"no such key (to add a key of your own: +{override})" if override else "no such key"
    return message


def unknown_key(full_key: str, schema) -> str:
    """``train has no key 'meta_iter' (did you mean train.meta_iters?)``."""
    group, _, key = full_key.rpartition(".")
    known = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {group}.{close[0]}?" if close else f"its keys: {', '.join(known)}"
    return f"{group} has no key '{key}' ({hint})"


def check_schema_keys(cfg, overrides: list[str], path: str = "") -> None:
    """Refuse keys a schema does not name, such as ``+train.meta_iter=5`` added them."""
    from omegaconf import DictConfig, OmegaConf

    for key in cfg.keys():
        node = cfg._get_node(key)
        if not isinstance(node, DictConfig):
            continue
        full_key = f"{path}{key}"
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema):
            known = {f.name for f in dataclasses.fields(schema)}
            for extra in (k for k in node.keys() if k not in known):
                inner = f"{full_key}.{extra}"
                shown = given(overrides, inner) or inner
                raise ConfigError(f"{shown}: {unknown_key(inner, schema)}")
        check_schema_keys(node, overrides, full_key + ".")


def check_key_names(cfg, overrides=(), path: str = "") -> None:
    """Refuse a key named like an attribute of the config object (``items``, ``keys``,
    ``values``, ``get``, ``pop`` ...): ``cfg.<group>.items`` is then DictConfig's method,
    not the value, and the code that reads it fails far from the cause.  Values are not
    resolved (an interpolation may make a folder)."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(cfg, ListConfig):
        children = [(f"{path.rstrip('.')}[{i}]", cfg._get_node(i)) for i in range(len(cfg))]
    else:
        children = [(f"{path}{key}", cfg._get_node(key)) for key in cfg.keys()]
        # what an instance's attribute finds before a key (not the metaclass's: register)
        taken = {name for klass in DictConfig.__mro__ for name in vars(klass)}
        for key in (k for k in cfg.keys() if k in taken):
            full_key = f"{path}{key}"
            shown = given(list(overrides), full_key) or full_key
            raise ConfigError(
                f"{shown}: {key!r} is the name of a method of the config object (reading "
                f"{full_key} would give the method, not the value): rename the key"
            )
    for full_key, node in children:
        if isinstance(node, (DictConfig, ListConfig)) and not (
            node._is_none() or node._is_missing() or node._is_interpolation()
        ):
            check_key_names(node, overrides, full_key + ".")


def hydra_override(message: str):
    """The override, as typed, that Hydra's ``message`` says it could not apply, else None."""
    lines = message.splitlines()
    if lines[0].startswith("Error merging override "):
        return lines[0][len("Error merging override ") :]
    if lines[0].startswith("Could not override ") and len(lines) > 1 and " use +" in lines[1]:
        return lines[1].split(" use +", 1)[1]
    return None


def given(overrides: list[str], full_key: str):
    """The override, as typed, that set ``full_key`` (or a key in it, or its list), else None."""
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if (
            full_key == key
            or full_key.startswith((key + ".", key + "["))
            or (key.startswith(full_key + "."))
        ):
            return override
    return None


def validate(cfg) -> None:
    """Raise :class:`ConfigError` for the first value out of range, or a key named like a
    method of the config object (:func:`check_key_names`; :func:`compose` refuses it first,
    this catches a config that Hydra composed alone).

    ``workers`` and ``servers`` are a count or an endpoint list, so no schema type checks
    them: here, in every mode, each must be a whole count of at least 1 or a ``host:port``
    list.  ``compile``'s option names are checked here too
    (:func:`kspipe.compiling.check_options`), not first in a cluster job's workers.
    """
    from kspipe.cluster.endpoints import parse_endpoints

    check_key_names(cfg)
    for key in ("workers", "servers"):
        parse_endpoints(cfg.get(key), key)
    if cfg.get("cluster") is not None and cfg.cluster.get("max_restarts") is not None:
        check_integer(cfg.cluster.max_restarts, "cluster.max_restarts", 0)
    if cfg.get("compile") is not None:  # a cluster job compiles in its workers, once begun
        from kspipe.compiling import check_options

        check_options(cfg)
