"""A small test kit for kspipe and its plugins, and the helpers kspipe's own tests share.

    from kspipe.testing import compose_config, tiny_overrides
    cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, data)])

Every helper is importable from here; each lives in the module of its kind:

* :mod:`kspipe.testing.runs`: runs in the test's own process (a composed config, a tiny
  data set, an MLflow store begun from an empty one, kspipe's registry with a test's
  plugins, a hook recorder, a busy machine);
* :mod:`kspipe.testing.commands`: the ``kspipe`` command in processes of its own (plugins
  installed as a user installs them, its one-line error, the runs and processes it left);
* :mod:`kspipe.testing.serving`: a run's MLflow model served, and what it must answer;
* :mod:`kspipe.testing.slurm`: a Slurm cluster on loopback;
* :mod:`kspipe.testing.disks`: a disk that fills, one that is read-only (root only).
"""

import os

os.environ.setdefault("GLOG_minloglevel", "2")

from kspipe.testing.disks import (disk_size, fill, mounts_missing, read_only,  # noqa: E402
                                  resize, small_disk)
from kspipe.testing.commands import (assert_one_line_error, install_plugin,  # noqa: E402
                                     job_processes, plugin_env, run_kspipe, run_statuses,
                                     stopped_when)
from kspipe.testing.runs import (CTR_LINES, CTR_MIN_AUC, SCHEDULED_COLLECTIVE,  # noqa: E402
                                 SCHEDULED_JOB, HookRecorder, QuietReporter, begun_store,
                                 compose_config, ctr_overrides, latest_weights, overloaded,
                                 plugin_manager, scheduled_overrides, tiny_omniglot,
                                 tiny_overrides)
from kspipe.testing.serving import (Server, a_test_task, invoke, model_server,  # noqa: E402
                                    reference_adaptation)
from kspipe.testing.slurm import local_slurm, slurm_missing, stop_daemon  # noqa: E402

__all__ = [
    "compose_config", "tiny_omniglot", "tiny_overrides", "begun_store", "ctr_overrides",
    "CTR_LINES", "CTR_MIN_AUC", "SCHEDULED_JOB", "SCHEDULED_COLLECTIVE", "scheduled_overrides",
    "latest_weights", "plugin_manager", "QuietReporter", "HookRecorder", "overloaded",
    "install_plugin", "plugin_env", "run_kspipe", "assert_one_line_error", "run_statuses",
    "job_processes", "stopped_when",
    "Server", "model_server", "invoke", "a_test_task", "reference_adaptation",
    "local_slurm", "slurm_missing", "stop_daemon",
    "small_disk", "read_only", "resize", "fill", "disk_size", "mounts_missing",
]
