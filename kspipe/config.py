"""Checks of the composed config that every run needs, whatever its workload and mode.

Each workload and mode checks its own keys in ``kspipe_check_config``.
"""

from __future__ import annotations

from kspipe.errors import ConfigError, check_integer


def validate(cfg) -> None:
    """Raise :class:`ConfigError` for the first value out of range."""
    if not isinstance(cfg.get("mode"), str):
        raise ConfigError(f"mode={cfg.get('mode')!r} must be a name such as local")
    for key in ("workers", "servers"):
        value = cfg.get(key)
        if not isinstance(value, str):  # a string is an endpoint list, checked by the mode
            check_integer(value, key, 1)


def check_keys(cfg, minimums: dict, numbers: tuple = ()) -> None:
    """Each ``key: minimum`` of ``minimums`` an integer of at least that; ``numbers`` at least 0."""
    for key, minimum in minimums.items():
        check_integer(lookup(cfg, key), key, minimum)
    for key in numbers:
        from kspipe.errors import check_number

        check_number(lookup(cfg, key), key, 0)


def lookup(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = value.get(part) if hasattr(value, "get") else None
    return value
