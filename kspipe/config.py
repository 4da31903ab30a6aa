"""Checks of the composed config that give one clear line per mistake."""

from __future__ import annotations

from kspipe.errors import ConfigError


def _require(cfg, key: str, minimum: int, kind=int) -> None:
    value = cfg
    for part in key.split("."):
        value = value.get(part) if hasattr(value, "get") else None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{key}={value!r} must be {'an integer' if kind is int else 'a number'}")
    if value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")


def validate(cfg) -> None:
    """Raise :class:`ConfigError` for the first value out of range."""
    if not isinstance(cfg.get("mode"), str):
        raise ConfigError(f"mode={cfg.get('mode')!r} must be a name such as local")
    for key in ("workers", "servers"):
        value = cfg.get(key)
        if isinstance(value, str):
            continue  # an endpoint list, checked by the mode that reads it
        _require(cfg, key, 1)
    for key, minimum in (("task.ways", 1), ("task.shots", 1), ("train.meta_iters", 0),
                         ("train.meta_batch", 1), ("train.inner_iters", 0),
                         ("train.inner_batch", 1), ("train.shots", 1), ("eval.tasks", 1), ("eval.train_tasks", 1),
                         ("eval.queries", 1), ("eval.inner_iters", 0), ("eval.inner_batch", 1),
                         ("eval.interval", 0), ("eval.interval_tasks", 1),
                         ("train.checkpoint_every", 0), ("train.keep_checkpoints", 1)):
        _require(cfg, key, minimum)
    for key in ("train.inner_lr", "train.meta_step", "train.meta_step_final"):
        _require(cfg, key, 0, kind=(int, float))
