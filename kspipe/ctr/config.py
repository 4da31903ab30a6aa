"""The ``ctr`` config group: the click-through model of ``stages.program=ctr``.

:class:`CtrConfig` is the group's schema, which the plugin declares with
``kspipe_config_schemas`` (:mod:`kspipe.ctr.plugin`): Hydra refuses a misspelt key or a value
of the wrong type while it composes the config; ranges are
:func:`kspipe.ctr.plugin.kspipe_check_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class CtrConfig:
    """Embedding tables per slot, a ReLU tower, and Adam."""

    embedding_dim: int = 8
    hash_size: int = 262144  # rows of each slot's embedding table (ids are taken modulo this)
    hidden: List[int] = field(default_factory=lambda: [64, 32])  # the tower's ReLU layers
    learning_rate: float = 0.002
    epochs: int = 2
