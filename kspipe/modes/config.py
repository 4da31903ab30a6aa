"""The ``cluster`` config group of the distributed modes (``mode=pserver`` and ``mode=collective``).

:class:`ClusterConfig` is the group's schema (option ``modes``, registered by
:func:`kspipe.schema.register_schemas`): Hydra refuses a misspelt key or a value of the wrong
type while it composes the config; the modes check the values themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class ClusterConfig:
    """How the processes of a distributed job exchange updates, and where they run."""

    strategy: str = "async"   # sync | async | geo (half_async is refused: Paddle 2.6.2 has none)
    k_steps: int = 1          # geo: local updates between rounds with the servers
    wait_push: bool = False   # async: wait until the servers apply each push (>= 100 ms a step)
    host: Optional[str] = None     # this host's address when the endpoint lists name several hosts
    threads: Optional[int] = None  # math threads per worker; default: cores / workers on this host
    timeout_s: Optional[float] = None  # stop the job if it runs longer (seconds)
    # a job across hosts: the first host's launcher listens here (default: worker 0's port + 2)
    control_port: Optional[int] = None
    hosts_timeout_s: float = 300.0  # ... and fails if another host's launcher has not come
    # the job's id, for processes a scheduler starts: they share outputs/job-<id> (default:
    # PADDLE_JOB_ID, SLURM_JOB_ID, else a digest of the endpoint lists; kspipe/job.py)
    job_id: Optional[str] = None
    # who starts the processes: processes (this launcher, itself) | slurm (srun job steps,
    # inside an allocation: kspipe/launchers/slurm.py) | paddlejob (a Kubernetes PaddleJob
    # manifest to apply: kspipe/launchers/kubernetes.py) | paddle (python -m
    # paddle.distributed.launch starts them: kspipe/launchers/paddle.py) | a plugin's
    launcher: str = "processes"
    slurm_args: List[str] = field(default_factory=list)  # sbatch options, when kspipe submits
    image: Optional[str] = None  # launcher=paddlejob: the pods' container image


def register(store) -> None:
    """Store the ``cluster`` schema in Hydra's ``store`` as its option ``modes``."""
    store.store(group="cluster", name="modes", node=ClusterConfig)
