"""Kept for plugins written against kspipe 0.1: roles now live in :mod:`kspipe.modes.role`."""

from kspipe.modes.role import ParameterSync, Role  # noqa: F401
