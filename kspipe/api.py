"""kspipe's public surface for plugin authors: import from here, never from kspipe's inner
modules, which move as kspipe grows (docs/plugins.md uses these names only).

    from kspipe.api import ConfigError, Workload, hookimpl, start_from

A name here keeps its meaning within a minor version; one that has to go first stays a
minor version with a ``DeprecationWarning`` saying what replaces it (CHANGELOG.md).
Importing this module loads neither Paddle nor MLflow.
"""

from kspipe import __version__, hookimpl
from kspipe.checkpoint import TABLES as CHECKPOINT_TABLES
from kspipe.checkpoint import Writer as CheckpointWriter
from kspipe.checkpoint import checkpoints
from kspipe.checkpoint import latest as latest_checkpoint
from kspipe.checkpoint import load as load_checkpoint
from kspipe.checkpoint import save as save_checkpoint
from kspipe.checkpoint.incremental import start_from
from kspipe.checkpoint.resizing import resumed as resumed_checkpoint
from kspipe.checkpoint.resizing import size as job_size
from kspipe.checkpoint.schedule import Schedule as CheckpointSchedule
from kspipe.cluster.endpoints import process_count
from kspipe.cluster.plan import Planned, launch_plan
from kspipe.contracts import NEEDS, Reporter, TrainingData, Workload
from kspipe.errors import (
    ClusterError,
    ConfigError,
    DataError,
    KspipeError,
    check_integer,
    check_number,
)
from kspipe.fewshot.data import FewShotDataset
from kspipe.files import cache_dir, files_digest, user_path
from kspipe.inference import export as export_inference_model
from kspipe.launchers.processes import ProcessLauncher
from kspipe.launchers.watcher import run_cluster
from kspipe.modes.job import ClusterJob
from kspipe.pipeline import prepare as prepare_pipeline
from kspipe.pipeline import run as run_pipeline
from kspipe.reptile.programs import ReptilePrograms
from kspipe.role import ParameterSync, Role
from kspipe.testing import (
    HookRecorder,
    QuietReporter,
    assert_one_line_error,
    begun_store,
    compose_config,
    install_plugin,
    plugin_env,
    plugin_manager,
    run_kspipe,
    run_statuses,
    tiny_omniglot,
    tiny_overrides,
)

__all__ = [
    # declaring a plugin and its workload
    "__version__",
    "hookimpl",
    "Workload",
    "NEEDS",
    "TrainingData",
    "Reporter",
    # what a stage gets, and what a mode or launcher subclasses
    "Role",
    "ParameterSync",
    "ClusterJob",
    "ProcessLauncher",
    "Planned",
    "launch_plan",
    "run_cluster",
    "process_count",
    "FewShotDataset",
    "ReptilePrograms",
    # one-line errors and checks
    "KspipeError",
    "ConfigError",
    "DataError",
    "ClusterError",
    "check_integer",
    "check_number",
    # files
    "user_path",
    "cache_dir",
    "files_digest",
    # checkpoints, resuming, starting from another run's model, the inference model
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "checkpoints",
    "CheckpointWriter",
    "CheckpointSchedule",
    "CHECKPOINT_TABLES",
    "resumed_checkpoint",
    "job_size",
    "start_from",
    "export_inference_model",
    # running a job in the test's process, and the test kit
    "run_pipeline",
    "prepare_pipeline",
    "compose_config",
    "plugin_manager",
    "HookRecorder",
    "QuietReporter",
    "install_plugin",
    "plugin_env",
    "run_kspipe",
    "assert_one_line_error",
    "run_statuses",
    "tiny_omniglot",
    "tiny_overrides",
    "begun_store",
]
