"""The spine: one run, stage by stage, from a composed config to its recorded result.

Every way into a run comes here: the ``kspipe`` command (:func:`hand_off`, :func:`prepare`,
:func:`run`), a process a launcher started (``python -m kspipe.cli.worker``: :func:`run`)
and a role a scheduler started with Paddle's environment (the command again).

    check config -> role -> [cluster job: launch the processes]
                  | [server: dataset -> program -> compile -> serve]
                  | [worker: dataset -> program -> compile -> execute -> save]

Each stage is the hook of the plugin that ``cfg.stages`` names for it, bracketed by
``kspipe_before_stage`` / ``kspipe_after_stage`` / ``kspipe_on_stage_error``; observers hear
``kspipe_run_start``, progress, metrics and artifacts, and ``kspipe_run_end`` or
``kspipe_run_error``.
"""

from __future__ import annotations

import json
import os

from omegaconf import open_dict
from pluggy import PluginManager

from kspipe import config as kconfig
from kspipe import job
from kspipe.checkpoint import incremental
from kspipe.errors import ConfigError, storage_error
from kspipe.launchers import restarts
from kspipe.process import heartbeat
from kspipe.registry.plugin_manager import STAGES, get_plugin_manager, implementers
from kspipe.reporting import Reporter, say

#: What a process of a cluster job does in each stage, for its launcher's watch of stalls
#: (kspipe/process/heartbeat.py); the role stage waits for the job's other processes to meet.
PHASES = {
    "role": ("joining the job", True),
    "dataset": ("reading the dataset",),
    "program": ("building the program",),
    "compile": ("compiling",),
    "execute": ("training",),
    "save": ("saving the model",),
}


def run(cfg, pm=None, workload=None) -> dict:
    """Run the job ``cfg`` describes; return its final metrics.

    :param workload: what :func:`prepare` returned for ``cfg``, when the caller prepared
        the run itself (the ``kspipe`` command does: its closing line shows the workload's
        metrics); else ``run`` prepares it.  Either way the workload is described once.

    Raises :class:`kspipe.errors.KspipeError` for a problem the user can fix.
    """
    pm = pm or get_plugin_manager()
    if workload is None:
        workload = prepare(cfg, pm)
    stages = Stages(pm, cfg)

    run_dir = os.path.abspath(cfg.run_dir)
    role = stages.call("role", cfg=cfg, launcher=process_launcher(pm, cfg))
    refusal = role.refuses(workload.needs, cfg)
    if refusal:
        raise ConfigError(f"mode={cfg.mode} cannot run the {workload.name} workload: {refusal}")
    os.makedirs(run_dir, exist_ok=True)
    reporter = Reporter(pm.hook, run_dir)

    pm.hook.kspipe_run_start(cfg=cfg, role=role, run_dir=run_dir, workload=workload)
    try:
        if role.is_cluster_job:  # it starts the job's processes, which run the stages
            metrics = restarts.launch(role, cfg, reporter)  # again, cluster.max_restarts
        else:
            metrics = run_stages(cfg, stages, role, reporter)
    except BaseException as error:
        pm.hook.kspipe_run_error(cfg=cfg, error=error)
        full = storage_error(error, f"the job's run folder: {run_dir}")
        if full:
            raise full from error
        raise
    pm.hook.kspipe_run_end(cfg=cfg, metrics=metrics, run_dir=run_dir)
    return metrics


def hand_off(cfg, pm, overrides: list[str]) -> str | None:
    """Where ``cluster.launcher`` gives the whole job to a scheduler (``sbatch``, a
    ``PaddleJob`` manifest): every check of :func:`check`, then the hand-off; the line
    that tells the user how to follow the job.  None where this command runs the job."""
    launcher = process_launcher(pm, cfg)
    if not launcher.hands_off(cfg):
        return None
    check(cfg, pm)
    return launcher.hand_off(cfg, overrides)


def prepare(cfg, pm):
    """Before anything starts: the run folder (``run_dir``, else :func:`kspipe.job.run_folder`
    chooses one), a job Slurm requeued resuming from its own latest checkpoint (``cfg``
    says so from here on), then :func:`check`; the workload it runs."""
    if not cfg.get("run_dir"):
        with open_dict(cfg):
            cfg.run_dir = job.run_folder(
                None, cfg.cluster.get("job_id"), cfg.cluster.get("launcher"), cfg.mode
            )
    requeued = job.requeued_checkpoint(cfg, os.path.abspath(cfg.run_dir))
    if requeued:
        with open_dict(cfg):
            cfg.resume, cfg.init_from = requeued, None
        say(
            f"Slurm requeued the job (restart {os.environ['SLURM_RESTART_COUNT']}): it "
            f"resumes from its latest complete checkpoint, {requeued}"
        )
    return check(cfg, pm)


def check(cfg, pm):
    """Every check of ``cfg`` made before anything starts (a :class:`ConfigError` in one
    line); the workload it runs (its :class:`kspipe.contracts.Workload`)."""
    kconfig.validate(cfg)
    check_mode(pm, cfg.mode)
    pm.hook.kspipe_check_config(cfg=cfg)
    incremental.check_source(cfg)  # before any process starts
    workload = describe_workload(pm, cfg)
    check_declared(cfg, workload)
    return workload


def check_declared(cfg, workload) -> None:
    """A run that asks its workload for what it does not declare is refused, not run as if
    it had been asked nothing: ``init_from`` without ``starts_from``; ``resume``, or a job
    that a restart would start again from its latest checkpoint, without ``resumes``.  (A
    job Slurm requeued has its ``resume`` set by :func:`prepare`, before this check.)
    These rules are new in kspipe 0.2.0: the line tells a plugin built for an older
    kspipe what to declare."""
    if cfg.get("init_from") and not workload.starts_from:
        raise ConfigError(
            undeclared(f"init_from={cfg.init_from}", workload, "starts_from", "given init_from=")
            + "calls kspipe.api.start_from"
        )
    if workload.resumes:
        return
    loads = "loads the checkpoint resume= names (kspipe.api.load_checkpoint)"
    if cfg.get("resume"):
        raise ConfigError(
            undeclared(f"resume={cfg.resume}", workload, "resumes", "given resume=") + loads
        )
    restarts = int(cfg.cluster.get("max_restarts") or 0) if cfg.get("cluster") else 0
    if restarts > 0:
        raise ConfigError(
            undeclared(f"cluster.max_restarts={restarts}", workload, "resumes", "a restart resumes")
            + f"{loads}; else set cluster.max_restarts=0 (it would start over from nothing)"
        )


def undeclared(setting: str, workload, flag: str, asked: str) -> str:
    """The start of the one line that refuses ``setting`` to a workload that does not
    declare ``flag``: a rule new in kspipe 0.2.0 (CHANGELOG.md), said so for a plugin built
    for an older kspipe; the caller ends it with what the execute stage must do."""
    return (
        f"{setting}: the {workload.name} workload does not declare {flag}=True, which "
        f"kspipe asks since 0.2.0 of a workload {asked} (CHANGELOG.md); a plugin built for "
        f"an older kspipe declares Workload({flag}=True) if its execute stage "
    )


def stage_caller(pm: PluginManager, stage: str, plugin_name: str):
    """Return a caller of ``stage``'s hook that reaches only the plugin ``plugin_name``."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage '{stage}' (stages: {', '.join(STAGES)})")
    available = implementers(pm, stage)
    if plugin_name not in available:
        raise ConfigError(
            f"stages.{stage}={plugin_name!r}: no installed plugin of that name serves the "
            f"{stage} stage (available: {', '.join(available) or 'none'})"
        )
    others = [p for name, p in pm.list_name_plugin() if name != plugin_name]
    return pm.subset_hook_caller(STAGES[stage], remove_plugins=others)


def describe_workload(pm: PluginManager, cfg):
    """What the plugin serving ``cfg.stages.program`` declares of its workload."""
    from kspipe.contracts import Workload

    name = cfg.stages.program
    others = [p for n, p in pm.list_name_plugin() if n != name]
    describe = pm.subset_hook_caller("kspipe_describe_workload", remove_plugins=others)
    return describe(cfg=cfg) or Workload(name=name, headline="", rate="")


def check_mode(pm: PluginManager, mode: str) -> None:
    """Fail with a clear error unless a plugin serves ``mode`` (it names the role plugin)."""
    available = implementers(pm, "role")
    if mode in available:
        return
    raise ConfigError(f"unknown mode '{mode}' (available: {', '.join(available)})")


def process_launcher(pm: PluginManager, cfg):
    """The process launcher ``cfg.cluster.launcher`` names (default ``processes``), from
    every plugin's ``kspipe_process_launchers``; an unknown name is one line."""
    name = cfg.cluster.get("launcher") or "processes"
    launchers = {
        launcher.name: launcher
        for found in pm.hook.kspipe_process_launchers()
        for launcher in found or ()
    }
    if name not in launchers:
        raise ConfigError(f"cluster.launcher={name!r} is not one of {', '.join(sorted(launchers))}")
    return launchers[name]


class Stages:
    """Calls each stage's chosen plugin, with the before/after/error hooks around it."""

    def __init__(self, pm, cfg):
        self.pm, self.cfg = pm, cfg
        self.callers = {name: stage_caller(pm, name, cfg.stages[name]) for name in STAGES}

    def call(self, stage: str, **kwargs):
        hook = self.pm.hook
        hook.kspipe_before_stage(stage=stage, cfg=self.cfg)
        try:
            with heartbeat.phase(*PHASES.get(stage, (stage,))):
                result = self.callers[stage](**kwargs)
        except BaseException as error:
            hook.kspipe_on_stage_error(stage=stage, cfg=self.cfg, error=error)
            raise
        hook.kspipe_after_stage(stage=stage, cfg=self.cfg, result=result)
        return result


def run_stages(cfg, stages: Stages, role, reporter) -> dict:
    """dataset -> program -> compile -> execute -> save, in this process's role."""
    import paddle

    paddle.enable_static()
    dataset = stages.call("dataset", cfg=cfg, role=role)
    programs = stages.call("program", cfg=cfg, dataset=dataset, role=role)
    programs = stages.call("compile", cfg=cfg, role=role, programs=programs)
    if role.is_server():
        role.run_server(reporter)
        return {}
    executor = make_executor(role.place(), reporter.run_dir)
    scope = paddle.static.Scope()
    try:
        metrics = (
            stages.call(
                "execute",
                cfg=cfg,
                role=role,
                dataset=dataset,
                programs=programs,
                executor=executor,
                scope=scope,
                reporter=reporter,
            )
            or {}
        )
        reporter.check(metrics)  # a non-finite value, reported from any thread or returned
        reporter.check_model(programs, scope)  # a non-finite parameter, before the export
        if role.is_first_worker():
            collect_graphs(cfg, reporter)
            model_dir = os.path.join(reporter.run_dir, "inference_model")
            stages.call(
                "save",
                cfg=cfg,
                role=role,
                programs=programs,
                executor=executor,
                scope=scope,
                dirname=model_dir,
            )
            if os.path.isdir(model_dir):  # a workload may export no inference model
                reporter.artifact(model_dir, "inference_model")
            with open(os.path.join(reporter.run_dir, "metrics.json"), "w") as f:
                json.dump(metrics, f, indent=1)
    except BaseException:
        role.stop_worker(clean=False)
        raise
    role.stop_worker(clean=True)
    return metrics


def make_executor(place, run_dir: str):
    """An executor whose debug descriptions (``train_from_dataset`` writes
    ``<id>_train_desc.prototxt`` into the current folder) go to ``<run_dir>/debug``."""
    import paddle

    executor = paddle.static.Executor(place)
    folder = os.path.join(run_dir, "debug")

    def dump_debug_info(program=None, trainer=None):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{id(program)}_train_desc.prototxt"), "w") as f:
            f.write(str(trainer))
        fleet_opt = getattr(program, "_fleet_opt", None) or {}
        if "fleet_desc" in fleet_opt:
            with open(os.path.join(folder, "fleet_desc.prototxt"), "w") as f:
                f.write(str(fleet_opt["fleet_desc"]))

    executor._dump_debug_info = dump_debug_info
    return executor


def collect_graphs(cfg, reporter) -> None:
    """The Graphviz files of ``compile.build_strategy.debug_graphviz_path``, as artifacts."""
    graph = (cfg.compile.get("build_strategy") or {}).get("debug_graphviz_path")
    if not graph:
        return
    folder = os.path.dirname(os.path.join(reporter.run_dir, graph))
    if os.path.isdir(folder):  # Paddle writes Graphviz files without a suffix
        for name in os.listdir(folder):
            if not name.endswith(".dot"):
                os.replace(os.path.join(folder, name), os.path.join(folder, name + ".dot"))
        reporter.artifact(folder, "graph")
