"""Runs in the test's own process: a composed config, a tiny data set and the overrides
that make a run take seconds, an MLflow store begun from an empty one, kspipe's registry
with a test's plugins, a reporter that shows nothing and a plugin that records every hook
call."""

from __future__ import annotations

from pathlib import Path

from kspipe import hookimpl


def compose_config(overrides: list[str] = (), config_dirs: list[str] = (), schemas=None):
    """The config ``kspipe <overrides>`` would run, composed without starting a job.

    It is composed with kspipe's schemas (:func:`kspipe.config.compose`): a value of the
    wrong type or a misspelt key raises :class:`kspipe.errors.ConfigError`.
    """
    from kspipe.config import compose

    return compose(overrides, config_dirs, schemas)


def tiny_omniglot(root: Path, characters: int = 30, drawers: int = 6, seed: int = 0) -> Path:
    """A small Omniglot-layout data set drawn from KanjiVG (cached under ``root``)."""
    from kspipe.fewshot import kanji

    return kanji.ensure(
        characters=characters,
        drawers=drawers,
        seed=seed,
        cache_dir=str(root),
        say=lambda message: None,
    )


def tiny_overrides(tmp_path: Path, data_root: Path, train_characters: int = 20) -> list[str]:
    """Overrides that make a run take seconds and write only under ``tmp_path``; its MLflow
    store, ``tmp_path/mlflow.db``, is begun from an empty one (:func:`begun_store`)."""
    return [
        f"dataset.root={data_root}",
        f"dataset.train_characters={train_characters}",
        f"run_dir={tmp_path / 'run'}",
        f"tracking.uri={begun_store(tmp_path)}",
        "tracking.model=false",  # tests of the MLflow model ask for it
        "model.filters=16",
        "train.meta_iters=4",
        "train.meta_batch=2",
        "train.inner_iters=2",
        "train.shots=3",
        "train.checkpoint_every=2",
        "task.ways=3",
        "task.shots=1",
        "eval.tasks=3",
        "eval.train_tasks=2",
        "eval.inner_iters=2",
        "eval.interval=2",
        "eval.interval_tasks=2",
    ]


def begun_store(folder: Path) -> str:
    """The URI of the MLflow store ``folder/mlflow.db``, begun (unless it exists) as a copy
    of an empty store made once per test process.

    MLflow takes seconds to create a SQLite store (it runs its schema's migrations), and
    each test's run would otherwise create one of its own.  What a new store does (jobs
    started together on one, under kspipe's lock) is tested where the store is left new."""
    import shutil

    folder = Path(folder)
    store = folder / "mlflow.db"
    if not store.exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_empty_store(), store)
    return f"sqlite:///{store}"


_EMPTY_STORE: list[Path] = []


def _empty_store() -> Path:
    """An MLflow store that MLflow created and nothing wrote to (in a folder of its own,
    removed when the process ends)."""
    if not _EMPTY_STORE:
        import atexit
        import shutil
        import subprocess
        import sys
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="kspipe-empty-store-"))
        atexit.register(shutil.rmtree, folder, True)
        store = folder / "mlflow.db"
        # in a process of its own, started in that folder: MLflow's default artifact
        # folder (./mlruns) is made there, not in the tests' current folder
        made = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from mlflow import "
                "MlflowClient; MlflowClient(tracking_uri=sys.argv[1])"
                ".search_experiments()",
                f"sqlite:///{store}",
            ],
            cwd=folder,
            capture_output=True,
            text=True,
        )
        assert made.returncode == 0, made.stderr[-3000:]
        _EMPTY_STORE.append(store)
    return _EMPTY_STORE[0]


def plugin_manager(*plugins, load_entrypoints: bool = False):
    """kspipe's registry with extra ``plugins`` registered (``(name, plugin)`` pairs or objects)."""
    from kspipe.registry.plugin_manager import get_plugin_manager

    pm = get_plugin_manager(load_entrypoints=load_entrypoints)
    for plugin in plugins:
        name, obj = plugin if isinstance(plugin, tuple) else (None, plugin)
        pm.register(obj, name=name)
    pm.check_pending()
    return pm


class QuietReporter:
    """A reporter that shows nothing, for a stage or learner called outside a run."""

    run_dir = ""

    def progress(self, *args, **kwargs) -> None:
        pass

    def say(self, message: str) -> None:
        pass

    def metrics(self, *args, **kwargs) -> None:
        pass

    def artifact(self, *args, **kwargs) -> None:
        pass


class HookRecorder:
    """A plugin that records every lifecycle hook call, to assert what a run reported."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def names(self) -> list[str]:
        """The hooks called, in order."""
        return [name for name, _ in self.calls]

    def metrics(self) -> dict:
        """Every metric logged, last value wins."""
        out: dict = {}
        for name, kwargs in self.calls:
            if name == "kspipe_log_metrics":
                out.update(kwargs["metrics"])
        return out

    @hookimpl
    def kspipe_check_config(self, cfg):
        self.calls.append(("kspipe_check_config", {}))

    @hookimpl
    def kspipe_run_start(self, cfg, role, run_dir):
        self.calls.append(("kspipe_run_start", {"role": role, "run_dir": run_dir}))

    @hookimpl
    def kspipe_progress(self, task, step, total, values):
        self.calls.append(("kspipe_progress", {"task": task, "step": step, "total": total}))

    @hookimpl
    def kspipe_log_metrics(self, metrics, step):
        self.calls.append(("kspipe_log_metrics", {"metrics": dict(metrics), "step": step}))

    @hookimpl
    def kspipe_log_artifact(self, path, artifact_path):
        self.calls.append(("kspipe_log_artifact", {"path": path, "artifact_path": artifact_path}))

    @hookimpl
    def kspipe_before_stage(self, stage, cfg):
        self.calls.append(("kspipe_before_stage", {"stage": stage}))

    @hookimpl
    def kspipe_after_stage(self, stage, cfg, result):
        self.calls.append(("kspipe_after_stage", {"stage": stage}))

    @hookimpl
    def kspipe_on_stage_error(self, stage, cfg, error):
        self.calls.append(("kspipe_on_stage_error", {"stage": stage, "error": error}))

    @hookimpl
    def kspipe_run_end(self, cfg, metrics, run_dir):
        self.calls.append(("kspipe_run_end", {"metrics": dict(metrics)}))

    @hookimpl
    def kspipe_run_error(self, cfg, error):
        self.calls.append(("kspipe_run_error", {"error": error}))
