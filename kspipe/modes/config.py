"""The modes' keys of the ``cluster`` config group (``mode=pserver`` and ``mode=collective``).

:class:`ModeConfig` is their schema, which the two modes that read it (pserver, collective)
declare with ``kspipe_config_schemas``;
the launchers' keys of the group are :class:`kspipe.launchers.config.LauncherConfig`, and
:func:`kspipe.config.schema.joined` makes the two one group.  Hydra refuses a misspelt key or a
value of the wrong type while it composes the config; the modes check the values themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ModeConfig:
    """How the processes of a distributed job exchange updates, and how each runs."""

    strategy: str = "async"  # sync | async | geo (half_async is refused: Paddle 2.6.2 has none)
    k_steps: int = 1  # geo: local updates between rounds with the servers
    wait_push: bool = False  # async: wait until the servers apply each push (>= 100 ms a step)
    shard_sum: bool = True  # sync, geo: sum part of each round beside the servers (3+ workers)
    host: Optional[str] = None  # this host's address when the endpoint lists name several hosts
    threads: Optional[int] = None  # math threads per worker; default: cores / workers on this host
    timeout_s: Optional[float] = None  # stop the job if it runs longer (seconds)
