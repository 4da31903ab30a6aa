"""What the modes' roles share: their base class and moving variables between a scope and
numpy.

A mode's role subclasses :class:`Role`, which is :class:`kspipe.role.Role` (the
one-process role, ``mode=local``; it lives in the core so a workload outside a job can use
it) and overrides what its mode does differently; :class:`ParameterSync` is the base of
its exchanges.  What a workload may ask of any role is :class:`kspipe.contracts.Role`.
"""

from __future__ import annotations

import numpy as np

from kspipe.role import ParameterSync, Role, check_reduce_mode

__all__ = ["ParameterSync", "Role", "check_reduce_mode", "read_vars", "write_vars"]


def read_vars(scope, names) -> dict:
    """``{name: numpy copy}`` of these variables of ``scope``."""
    return {n: np.array(scope.find_var(n).get_tensor()) for n in names}


def write_vars(scope, values: dict, place=None) -> None:
    """Set these variables of ``scope`` from numpy arrays (on ``place``, default CPU)."""
    import paddle

    place = place or paddle.CPUPlace()
    for name, value in values.items():
        scope.var(name).get_tensor().set(np.asarray(value), place)
