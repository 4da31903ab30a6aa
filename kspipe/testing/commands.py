"""The ``kspipe`` command in processes of its own: plugins installed as a user installs
them, the command run, its one-line error and the runs it left in the MLflow store."""

from __future__ import annotations

import os
from pathlib import Path


def install_plugin(site: Path, package: Path, entry_point: str, version: str = "0.1.0") -> None:
    """Install the plugin package folder ``package`` into the folder ``site`` as pip would:
    a copy of it and a dist-info whose entry point ``entry_point`` (``name = module``) is in
    kspipe's group.  :func:`plugin_env` then finds it."""
    import shutil

    shutil.copytree(package, site / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"{package.name}-{version}.dist-info"
    info.mkdir()
    name = package.name.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kspipe]\n{entry_point}\n")


def plugin_env(site: Path) -> dict:
    """The environment of a ``kspipe`` command that loads the plugins installed in ``site``
    (before the folders a ``PYTHONPATH`` already names, such as a checkout's)."""
    given = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *([given] if given else [])]))
    env.pop("KSPIPE_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def run_kspipe(*args: str, cwd, env: dict | None = None, timeout: float = 600):
    """``kspipe <args>`` in a process of its own, in ``cwd``; its ``CompletedProcess``
    (text output captured)."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "kspipe.cli.command", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(result, *fragments: str) -> None:
    """``result`` (of :func:`run_kspipe`) failed with exactly one ``kspipe: error:`` line,
    holding every one of ``fragments``, and no traceback."""
    assert result.returncode != 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def run_statuses(db: Path) -> list[str]:
    """The statuses of the runs in the MLflow store ``db`` (an SQLite file), sorted; none
    if the store was never made or holds no run table yet."""
    import sqlite3

    if not Path(db).exists():
        return []
    try:
        with sqlite3.connect(db) as con:
            return sorted(status for (status,) in con.execute("select status from runs"))
    except sqlite3.OperationalError:  # a store begun, no run table in it
        return []
