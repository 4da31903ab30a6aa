"""kspipe: a plugin-based workflow pipeline for distributed PaddlePaddle training.

This module holds only the ``hookimpl`` marker that plugins decorate their stage
implementations with; the hook specifications live in :mod:`kspipe.registry.hookspecs`.
"""

import pluggy

NAME = "kspipe"
__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker(NAME)

__all__ = ["NAME", "__version__", "hookimpl"]
