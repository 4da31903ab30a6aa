"""The layout's limits, kept by a check rather than by memory: no Python file of the
project (kspipe, its tests, benches, examples and plugins) over 400 lines, no folder of
kspipe over 12 modules, and the folders docs/design.md names each holding one concern's
modules."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOST_LINES = 400


#: The folders of Python the project writes: the package, its tests and their plugins,
#: the benches, the examples and the plugin packages it ships.
FOLDERS = ("kspipe", "conf", "tests", "bench", "examples", "plugins")


def python_files(folders=FOLDERS) -> list[Path]:
    return sorted(
        p
        for folder in folders
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    )


def modules() -> list[Path]:
    """kspipe's own modules."""
    return python_files(("kspipe",))


def test_no_python_file_is_over_400_lines():
    """kspipe's modules, and the tests and benches too: a test file past 400 lines holds
    more than one concern, and its module fixtures grow with it."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in python_files()
        if (n := len(p.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"files over {MOST_LINES} lines (split them by concern): {long}"


MOST_MODULES = 12


def test_no_folder_of_kspipe_holds_more_than_12_modules():
    """A folder past a dozen modules holds more than one concern: the top level once grew to
    23 (checkpoints, a process's life and the registry now have folders of their own)."""
    counts: dict = {}
    for path in modules():
        folder = str(path.parent.relative_to(ROOT))
        counts[folder] = counts.get(folder, 0) + 1
    crowded = {folder: n for folder, n in counts.items() if n > MOST_MODULES}
    assert not crowded, f"folders over {MOST_MODULES} modules: {crowded}"


def test_each_concern_has_its_folder():
    """The cluster's vocabulary, the launchers, the modes with the parameter servers'
    exchange, MLflow and the command each live in a folder of their own."""
    expected = {
        "cluster": {"plan.py", "environment.py", "endpoints.py", "meeting.py"},
        "launchers": {"watcher.py", "processes.py", "slurm.py", "paddle.py", "kubernetes.py"},
        "modes": {"role.py", "job.py", "local.py", "pserver.py", "collective.py", "summing.py"},
        "modes/ps": {"exchange.py", "dense.py", "tables.py"},
        "observers/mlflow": {"tracking.py", "store.py", "serving.py"},
        "cli": {"command.py", "plugins.py", "worker.py"},
        "checkpoint": {"__init__.py", "schedule.py", "tables.py", "resizing.py"},
        "process": {"stopping.py", "memory.py", "heartbeat.py"},
        "registry": {"hookspecs.py", "plugin_manager.py"},
        "config": {"__init__.py", "schema.py"},
    }
    for folder, names in expected.items():
        present = {p.name for p in (ROOT / "kspipe" / folder).glob("*.py")}
        assert names <= present, f"kspipe/{folder} lacks {sorted(names - present)}"


def test_only_the_mlflow_folder_imports_mlflow():
    """Every module that imports MLflow is in kspipe/observers/mlflow (the job's own
    process never imports it)."""
    outside = []
    for path in modules():
        relative = path.relative_to(ROOT / "kspipe")
        if relative.parts[:2] == ("observers", "mlflow") or relative.parts[0] == "testing":
            continue
        text = path.read_text()
        if "import mlflow" in text or "from mlflow" in text:
            outside.append(str(relative))
    assert not outside, f"modules outside kspipe/observers/mlflow import MLflow: {outside}"
