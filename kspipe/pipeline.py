"""The spine: one run, stage by stage, from a composed config to its recorded result.

    validate config -> role -> dataset -> program -> compile -> execute -> save

Each stage is the hook of the plugin that ``cfg.stages`` names for it; observers hear
``kspipe_run_start``, progress, metrics and artifacts, and ``kspipe_run_end`` or
``kspipe_run_error``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kspipe import config as kconfig
from kspipe.plugin_manager import STAGES, check_mode, get_plugin_manager, stage_caller


class Reporter:
    """What a stage reports goes through here to the lifecycle hooks."""

    def __init__(self, hook, run_dir: str):
        self._hook = hook
        self.run_dir = run_dir

    def progress(self, task: str, step: int, total: int, values: dict | None = None) -> None:
        self._hook.kspipe_progress(task=task, step=step, total=total, values=values or {})

    def metrics(self, metrics: dict, step: int) -> None:
        self._hook.kspipe_log_metrics(metrics=dict(metrics), step=step)

    def artifact(self, path: str, artifact_path: str = "") -> None:
        self._hook.kspipe_log_artifact(path=path, artifact_path=artifact_path)

    @staticmethod
    def say(message: str) -> None:
        print(f"kspipe: {message}", file=sys.stderr, flush=True)


def run(cfg, pm=None) -> dict:
    """Run the job ``cfg`` describes; return its final metrics.

    Raises :class:`kspipe.errors.KspipeError` for a problem the user can fix.
    """
    kconfig.validate(cfg)
    pm = pm or get_plugin_manager()
    check_mode(pm, cfg.mode)
    pm.hook.kspipe_check_config(cfg=cfg)
    stage = {name: stage_caller(pm, name, cfg.stages[name]) for name in STAGES}

    role = stage["role"](cfg=cfg)
    run_dir = os.path.abspath(cfg.run_dir or default_run_dir())
    os.makedirs(run_dir, exist_ok=True)
    reporter = Reporter(pm.hook, run_dir)

    pm.hook.kspipe_run_start(cfg=cfg, role=role, run_dir=run_dir)
    try:
        if role.is_launcher:  # it starts the job's processes, which run the stages
            metrics = role.launch(reporter)
        else:
            metrics = run_stages(cfg, stage, role, reporter)
    except BaseException as error:
        pm.hook.kspipe_run_error(cfg=cfg, error=error)
        raise
    pm.hook.kspipe_run_end(cfg=cfg, metrics=metrics, run_dir=run_dir)
    return metrics


def run_stages(cfg, stage, role, reporter) -> dict:
    """dataset -> program -> compile -> execute -> save, in this process's role."""
    import paddle

    paddle.enable_static()
    dataset = stage["dataset"](cfg=cfg, role=role)
    programs = stage["program"](cfg=cfg, dataset=dataset)
    programs = stage["compile"](cfg=cfg, role=role, programs=programs)
    executor = paddle.static.Executor(role.place())
    scope = paddle.static.Scope()
    metrics = stage["execute"](cfg=cfg, role=role, dataset=dataset, programs=programs,
                               executor=executor, scope=scope, reporter=reporter) or {}
    graph = (cfg.compile.get("build_strategy") or {}).get("debug_graphviz_path")
    if graph and role.is_first_worker():
        folder = os.path.dirname(os.path.join(reporter.run_dir, graph))
        if os.path.isdir(folder):  # Paddle writes Graphviz files without a suffix
            for name in os.listdir(folder):
                if not name.endswith(".dot"):
                    os.replace(os.path.join(folder, name), os.path.join(folder, name + ".dot"))
            reporter.artifact(folder, "graph")
    if role.is_first_worker():
        model_dir = os.path.join(reporter.run_dir, "inference_model")
        stage["save"](cfg=cfg, role=role, programs=programs, executor=executor, scope=scope,
                      dirname=model_dir)
        reporter.artifact(model_dir, "inference_model")
        with open(os.path.join(reporter.run_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=1)
    return metrics


def default_run_dir() -> str:
    return os.path.join("kspipe-runs", time.strftime("%Y-%m-%d_%H-%M-%S"))
