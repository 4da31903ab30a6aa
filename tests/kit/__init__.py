"""The helpers kspipe's own tests share, beside the public test kit :mod:`kspipe.testing`
(which plugin authors use too); none of this is in kspipe's wheel.

* :mod:`tests.kit.jobs`: the suite's small jobs (the tiny job schedulers start, the small
  ctr job and the AUC it must reach) and the weights of a run's latest checkpoint;
* :mod:`tests.kit.processes`: a job's processes still running, a command stopped as a user
  stops it, a busy machine;
* :mod:`tests.kit.adaptation`: what a Reptile run's served model must answer;
* :mod:`tests.kit.slurm`: a Slurm cluster on loopback (or on emulated hosts);
* :mod:`tests.kit.workers`: a job's workers as threads, for the sums over them;
* :mod:`tests.kit.summers`: a job's workers and servers for the sums with shard summers;
* :mod:`tests.kit.strangers`: strangers at kspipe's sockets (silent, resetting, an
  eavesdropper who replays), and a process's thread count;
* :mod:`tests.kit.disks`: a disk that fills, one that is read-only (root only);
* :mod:`tests.kit.setups`: which of Slurm, Chromium and mountable disks must work on this
  machine, and why one is missing;
* :mod:`tests.kit.browser`: the text a page shows in a headless Chromium.
"""

from tests.kit.adaptation import a_test_task, reference_adaptation
from tests.kit.browser import page_text
from tests.kit.disks import disk_size, fill, mounts_missing, read_only, resize, small_disk
from tests.kit.jobs import (
    CTR_LINES,
    CTR_MIN_AUC,
    SCHEDULED_COLLECTIVE,
    SCHEDULED_JOB,
    ctr_overrides,
    latest_weights,
    scheduled_overrides,
)
from tests.kit.processes import (
    environment_of,
    job_processes,
    overloaded,
    role_pid,
    stopped_when,
    wait_until,
)
from tests.kit.setups import chromium_missing, missing_here, must_work_here
from tests.kit.slurm import local_slurm, slurm_missing, stop_daemon

__all__ = [
    "page_text",
    "SCHEDULED_JOB",
    "SCHEDULED_COLLECTIVE",
    "scheduled_overrides",
    "CTR_LINES",
    "CTR_MIN_AUC",
    "ctr_overrides",
    "latest_weights",
    "environment_of",
    "job_processes",
    "role_pid",
    "stopped_when",
    "wait_until",
    "overloaded",
    "a_test_task",
    "reference_adaptation",
    "local_slurm",
    "slurm_missing",
    "stop_daemon",
    "small_disk",
    "read_only",
    "resize",
    "fill",
    "disk_size",
    "mounts_missing",
    "chromium_missing",
    "must_work_here",
    "missing_here",
]
