"""The hook specifications: configuration, one hook per pipeline stage, then the
lifecycle hooks.

A run flows through the stage hooks in this order (see :func:`kspipe.pipeline.run`)::

    kspipe_assign_role -> kspipe_read_dataset -> kspipe_build_program
        -> kspipe_compile_program -> kspipe_execute -> kspipe_save_inference_model

and every stage is bracketed by ``kspipe_before_stage`` and ``kspipe_after_stage`` (or
``kspipe_on_stage_error``), so an observer can time or trace any of them.

Each stage is served by exactly one plugin, chosen by name in the config
(``stages.<stage>``, see :data:`kspipe.registry.plugin_manager.STAGES`); the stage hooks
are ``firstresult`` and called only on that plugin.  The lifecycle hooks
(``kspipe_run_start`` ... ``kspipe_run_error``) are called on every plugin:
tracking, progress display and other observers implement them.

Calls are keyword-only.  An implementation may accept fewer arguments than its
spec, so specs can grow without breaking plugins.  Implementations must not
give their parameters defaults.
"""

from __future__ import annotations

import pluggy

from kspipe import NAME
from kspipe.contracts import ClusterJob, Config, ProcessLauncher, Reporter, Role, Workload

hookspec = pluggy.HookspecMarker(NAME)


# --- configuration ------------------------------------------------------------------


@hookspec
def kspipe_config_dirs() -> list[str]:
    """Return config folders to add to Hydra's search path.

    Hydra search-path entries (``pkg://package.conf`` or ``file:///abs/path``) that hold
    config groups of a plugin, for example its own ``experiment/*.yaml``.  They are added
    before the config is composed.
    """


@hookspec
def kspipe_config_schemas() -> dict[str, type]:
    """Return ``{group: dataclass}``: the schemas of the config groups this plugin owns.

    Each becomes a typed key of the config before the experiment and the command line are
    merged in, so a misspelt key or a value of the wrong type in the group is refused in
    one line, as in kspipe's own groups, and every field's default is in the config.
    kspipe's built-in plugins declare their groups here too; a group of theirs is kspipe's
    own, which an installed plugin cannot declare.

    Several plugins may declare one group, each with a dataclass of keys of its own: the
    group then has the keys of all of them, in the order the plugins were registered (as
    ``cluster`` has the modes' keys, then the launchers').  A dataclass several plugins
    return counts once; a key two dataclasses declare is refused in one line.
    """


@hookspec
def kspipe_process_launchers() -> list[ProcessLauncher]:
    """Return the process launchers this plugin adds, each chosen by its ``name`` with
    ``cluster.launcher=<name>`` (base class :class:`kspipe.launchers.processes.ProcessLauncher`:
    where a job's planned processes go and how each is started).

    Called on every plugin; kspipe's own are ``processes``, ``slurm`` and ``paddlejob``.
    """


# --- stages, in the order a run calls them -----------------------------------------


@hookspec(firstresult=True)
def kspipe_describe_workload(cfg: Config) -> Workload:
    """Say what the workload is, which metrics tell of it, and what it needs of a mode.

    Stops at the first non-None result; asked of the plugin ``cfg.stages.program`` names,
    once per run, before anything starts (:func:`kspipe.pipeline.check`); the answer goes
    to ``kspipe_run_start`` and to the command's closing line.

    :param cfg: the composed config.
    :return: a :class:`kspipe.contracts.Workload`.
    """


@hookspec(firstresult=True)
def kspipe_assign_role(cfg: Config, launcher: ProcessLauncher) -> Role | ClusterJob:
    """Decide this process's role in the job (stage ``role``).

    Stops at the first non-None result.

    :param cfg: the composed config.
    :param launcher: the process launcher ``cluster.launcher`` names, for a
        :class:`kspipe.contracts.ClusterJob` to place and start the job's processes with.
    :return: a :class:`kspipe.contracts.Role` (the seed's RoleMaker API and the mode's
        distribution: ``distributed_optimizer``, ``parameter_sync``, ``init_worker`` ...;
        base class :class:`kspipe.modes.role.Role`).  Or a
        :class:`kspipe.contracts.ClusterJob`, which starts the job's processes itself; the
        pipeline then reports the cluster job's result.
    """


@hookspec(firstresult=True)
def kspipe_read_dataset(cfg: Config, role: Role) -> object:
    """Read the data set the job trains and evaluates on (stage ``dataset``).

    Stops at the first non-None result.

    :param cfg: the composed config.
    :param role: this process's role, to pick a worker's share of the data.
    :return: a data set object the program and execute stages understand; for few-shot
        learning a :class:`kspipe.fewshot.data.FewShotDataset` of
        :class:`kspipe.contracts.FewShotClass` classes.
    """


@hookspec(firstresult=True)
def kspipe_build_program(cfg: Config, dataset: object, role: Role) -> object:
    """Build the static-graph programs of the model (stage ``program``).

    Stops at the first non-None result.

    :param cfg: the composed config.
    :param dataset: what ``kspipe_read_dataset`` returned (gives image shape and classes).
    :param role: this process's role (``role.embedding`` puts tables where the mode keeps them).
    :return: a programs object, for Reptile a :class:`kspipe.reptile.programs.ReptilePrograms`.
    """


@hookspec(firstresult=True)
def kspipe_compile_program(cfg: Config, role: Role, programs: object) -> object:
    """Transpile or compile the programs for this role (stage ``compile``).

    Where the workload makes its training distributed: ``role.distributed_optimizer(opt)``
    or ``role.parameter_sync(shapes)``.  Runs on parameter servers too (they take their
    tables from it).

    Stops at the first non-None result.

    :param cfg: the composed config.
    :param role: this process's role.
    :param programs: what ``kspipe_build_program`` returned.
    :return: the programs to execute (the same object, changed, or a new one).
    """


@hookspec(firstresult=True)
def kspipe_execute(
    cfg: Config,
    role: Role,
    dataset: object,
    programs: object,
    executor: object,
    scope: object,
    reporter: Reporter,
) -> dict:
    """Run the job: train, evaluate, checkpoint (stage ``execute``).

    Stops at the first non-None result.  Workers only (servers run ``role.run_server``).
    Call ``role.init_worker(scope)`` after the startup program and
    ``role.finish_training(scope)`` after the training loop; the pipeline calls
    ``role.stop_worker()`` after the save stage.

    :param cfg: the composed config.
    :param role: this process's role.
    :param dataset: what ``kspipe_read_dataset`` returned.
    :param programs: what ``kspipe_compile_program`` returned.
    :param executor: the ``paddle.static.Executor`` for this role's place.
    :param scope: the ``paddle.static.Scope`` the programs' variables live in.
    :param reporter: a :class:`kspipe.contracts.Reporter`; report progress, metrics and
        artifacts through it, never to a tracking library directly.
    :return: a dict of the final metrics (name to float).
    """


@hookspec(firstresult=True)
def kspipe_save_inference_model(
    cfg: Config, role: Role, programs: object, executor: object, scope: object, dirname: str
) -> str:
    """Save the trained model for inference (stage ``save``).

    Stops at the first non-None result.  Only the first worker is asked.

    :param cfg: the composed config.
    :param role: this process's role.
    :param programs: the executed programs.
    :param executor: the executor that trained them.
    :param scope: the scope holding the trained parameters.
    :param dirname: the folder to save into.
    :return: the path prefix of the saved model (loadable by
        ``paddle.static.load_inference_model``).
    """


# --- lifecycle: called on every plugin ---------------------------------------------


@hookspec
def kspipe_check_config(cfg: Config) -> None:
    """Check the composed config before anything starts (before the role stage).

    Called on every plugin; each checks what it serves (for a stage plugin: when
    ``cfg.stages`` names it) and raises :class:`kspipe.errors.ConfigError` with one
    clear line.  A cluster job's command calls it too, so a mistake stops the job before
    any process is started.

    :param cfg: the composed config.
    """


@hookspec
def kspipe_run_start(
    cfg: Config, role: Role | ClusterJob, run_dir: str, workload: Workload
) -> None:
    """A run starts, after the config was validated and the role assigned.

    :param cfg: the composed config.
    :param role: this process's role.
    :param run_dir: the folder the run writes its files to.
    :param workload: what the run's workload plugin declares of it (described once per run).
    """


@hookspec
def kspipe_progress(task: str, step: int, total: int, values: dict) -> None:
    """Show how far a long piece of work has come.

    :param task: what is running, e.g. ``"meta-train"`` or ``"evaluate"``.
    :param step: how many units are done.
    :param total: how many units there are.
    :param values: figures to show beside it (loss, accuracy, ...).
    """


@hookspec
def kspipe_log_metrics(metrics: dict, step: int) -> None:
    """Record metrics at a step.

    :param metrics: metric name to float.
    :param step: the step (meta-iteration) they belong to.
    """


@hookspec
def kspipe_log_artifact(path: str, artifact_path: str) -> None:
    """Record a file or folder produced by the run.

    :param path: the local file or folder.
    :param artifact_path: the folder to place it under in the run's artifacts ("" for top).
    """


@hookspec
def kspipe_before_stage(stage: str, cfg: Config) -> None:
    """A stage is about to run.

    :param stage: the stage's name (``role``, ``dataset``, ``program``, ``compile``,
        ``execute``, ``save``).
    :param cfg: the composed config.
    """


@hookspec
def kspipe_after_stage(stage: str, cfg: Config, result: object) -> None:
    """A stage returned.

    :param stage: the stage's name.
    :param cfg: the composed config.
    :param result: what its hook returned.
    """


@hookspec
def kspipe_on_stage_error(stage: str, cfg: Config, error: BaseException) -> None:
    """A stage raised (the error is raised again afterwards, and ``kspipe_run_error`` follows).

    :param stage: the stage's name.
    :param cfg: the composed config.
    :param error: what it raised.
    """


@hookspec
def kspipe_run_end(cfg: Config, metrics: dict, run_dir: str) -> None:
    """A run finished successfully.

    :param cfg: the composed config.
    :param metrics: the final metrics.
    :param run_dir: the folder the run wrote its files to.
    """


@hookspec
def kspipe_run_error(cfg: Config, error: BaseException) -> None:
    """A run failed (the error is re-raised after this hook).

    :param cfg: the composed config.
    :param error: the exception that ended the run.
    """
