"""A small test kit for kspipe's plugins (kspipe's own tests use it too).

    from kspipe.testing import compose_config, tiny_overrides
    cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, data)])

Every helper is importable from here; each lives in the module of its kind:

* :mod:`kspipe.testing.runs`: runs in the test's own process (a composed config, a tiny
  data set, an MLflow store begun from an empty one, kspipe's registry with a test's
  plugins, a reporter that shows nothing, a hook recorder);
* :mod:`kspipe.testing.commands`: the ``kspipe`` command in a process of its own (plugins
  installed as a user installs them, its one-line error, the runs it left);
* :mod:`kspipe.testing.serving`: a run's MLflow model served, and a request to it.

Importing it changes nothing in the process (its environment, Paddle's flags): a test
that wants Paddle's C++ log quiet sets ``GLOG_minloglevel`` itself, before Paddle is
imported.  The pieces only kspipe's own suite needs (a Slurm on loopback, mounted disks,
the suite's jobs) are in the checkout's ``tests/kit``, not here.
"""

from kspipe.testing.commands import (
    assert_one_line_error,
    install_plugin,
    plugin_env,
    run_kspipe,
    run_statuses,
)
from kspipe.testing.runs import (
    HookRecorder,
    QuietReporter,
    begun_store,
    compose_config,
    plugin_manager,
    tiny_omniglot,
    tiny_overrides,
)
from kspipe.testing.serving import Server, invoke, model_server

__all__ = [
    "compose_config",
    "tiny_omniglot",
    "tiny_overrides",
    "begun_store",
    "plugin_manager",
    "QuietReporter",
    "HookRecorder",
    "install_plugin",
    "plugin_env",
    "run_kspipe",
    "assert_one_line_error",
    "run_statuses",
    "Server",
    "model_server",
    "invoke",
]
