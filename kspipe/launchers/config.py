"""The launchers' keys of the ``cluster`` config group: who starts a job's processes, and
how the hosts of a job across hosts meet.

:class:`LauncherConfig` is their schema, which the default launcher's module
(:mod:`kspipe.launchers.processes`) declares for them all with ``kspipe_config_schemas``;
the modes' keys of the group are :class:`kspipe.modes.config.ModeConfig`, and
:func:`kspipe.config.schema.joined` makes the two one group.  Hydra refuses a misspelt key or a
value of the wrong type while it composes the config; the launchers check the values
themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class LauncherConfig:
    """Who starts the processes, where they meet, and what a scheduler is given."""

    # a job across hosts: the first host's launcher listens here (default: worker 0's port + 2)
    control_port: Optional[int] = None
    hosts_timeout_s: float = 300.0  # ... and fails if another host's launcher has not come
    # a job across hosts: a host's launcher not heard from for this long (a lost machine, a
    # cut link: no FIN, no RST) fails the job there, a failure a restart may mend.  The
    # launchers say "alive" every quarter of it (a line of 6 bytes; kspipe/launchers/hosts.py)
    peer_timeout: float = 15.0
    # a process that makes no progress (no step, no exchange, no phase begun or ended) for
    # this long counts as failed and the job is stopped (kspipe/launchers/stalls.py); null:
    # never.  Longer than any phase of a healthy job without a step.
    stall_seconds: Optional[float] = 600.0
    # a file holding the job's secret (its processes' proof to kspipe's sockets), the same
    # on every host of a job across hosts; else KSPIPE_JOB_SECRET, else one job host makes
    # one (kspipe/cluster/secret.py)
    secret_file: Optional[str] = None
    # the job's id, for processes a scheduler starts: they share outputs/job-<id> (default:
    # PADDLE_JOB_ID, SLURM_JOB_ID, else a digest of the endpoint lists; kspipe/job.py)
    job_id: Optional[str] = None
    # who starts the processes: processes (this launcher, itself) | slurm (srun job steps,
    # inside an allocation: kspipe/launchers/slurm.py) | paddlejob (a Kubernetes PaddleJob
    # manifest to apply: kspipe/launchers/kubernetes.py) | paddle (python -m
    # paddle.distributed.launch starts them: kspipe/launchers/paddle.py) | a plugin's
    launcher: str = "processes"
    # how many times a job whose process died (a signal, a crash, a host lost) starts again
    # from its latest checkpoint, in the same run (kspipe/launchers/restarts.py).  0: a
    # restart repeats the work since that checkpoint and can hide a failing machine, so it
    # is asked for; a long job across hosts, where one lost process should not end it, sets
    # a few (3, as is common with TorchElastic).  Schedulers restart on their own too:
    # Slurm's --requeue, a PaddleJob's own settings (the manifest carries this value)
    max_restarts: int = 0
    slurm_args: List[str] = field(default_factory=list)  # sbatch options, when kspipe submits
    image: Optional[str] = None  # launcher=paddlejob: the pods' container image
