"""The plugin authors' API holds: every name docs/plugins.md uses comes from ``kspipe.api``
and imports, the guide imports from nowhere else, a module that moved still imports under
its old name with a warning that says where it went, and kspipe's version is one number
that CHANGELOG.md describes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import kspipe
import kspipe.api

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "plugins.md").read_text()

#: ``from kspipe... import a, b`` or ``from kspipe... import (\n a,\n b,\n)``.
IMPORT = re.compile(r"^from (kspipe[\w.]*) import (\([^)]*\)|[\w, ]+)$", re.M)


def imported(text: str) -> dict:
    """``{module: [name, ...]}`` of the guide's import lines."""
    found: dict = {}
    for module, names in IMPORT.findall(text):
        found.setdefault(module, []).extend(re.findall(r"\w+", names))
    return found


def test_the_guide_imports_from_kspipe_api_only():
    modules = set(imported(GUIDE)) | set(re.findall(r"^import (kspipe[\w.]*)", GUIDE, re.M))
    assert modules == {"kspipe.api"}, f"docs/plugins.md imports from {sorted(modules)}"


def test_every_name_the_guide_uses_imports_from_kspipe_api():
    spans = set(re.findall(r"`kspipe\.api\.(\w+)", GUIDE))
    names = spans | set(imported(GUIDE)["kspipe.api"])
    assert len(names) >= 30
    missing = sorted(name for name in names if name not in kspipe.api.__all__)
    assert not missing, f"docs/plugins.md uses kspipe.api names it does not export: {missing}"
    namespace: dict = {}
    exec(f"from kspipe.api import {', '.join(sorted(names))}", namespace)
    assert all(namespace[name] is not None for name in names)


def test_the_guide_names_everything_kspipe_api_exports():
    unnamed = [
        name
        for name in kspipe.api.__all__
        if name != "__version__" and not re.search(rf"\b{name}\b", GUIDE)
    ]
    assert not unnamed, f"kspipe.api exports names docs/plugins.md does not mention: {unnamed}"


def test_importing_kspipe_api_loads_neither_paddle_nor_mlflow():
    """A plugin imports it when kspipe loads the plugin, on every command."""
    script = (
        "import sys, kspipe.api\nprint([m for m in ('paddle', 'mlflow') if m in sys.modules])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


#: Imports each old name in a process of its own, recording the warnings each gives.
OLD_NAMES = """
import importlib, json, sys, warnings
import kspipe
found = {}
for old, new in kspipe.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    names = [n for n in vars(target) if not n.startswith("_")]
    found[old] = {
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "same": all(getattr(module, n) is getattr(target, n) for n in names),
    }
print(json.dumps(found))
"""


def test_a_module_that_moved_imports_under_its_old_name_with_a_warning_saying_where():
    """The guide of 2026-11-27 had plugins import ``kspipe.incremental``; it and every
    module moved since answer for a minor version, with the same objects."""
    assert kspipe.MOVED["kspipe.incremental"] == "kspipe.checkpoint.incremental"
    for old in kspipe.MOVED:
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} is a module"
    result = subprocess.run(
        [sys.executable, "-c", OLD_NAMES], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for old, seen in json.loads(result.stdout).items():
        new = kspipe.MOVED[old]
        assert seen["same"], f"{old} does not give {new}'s objects"
        assert [w for w in seen["warnings"] if f"{old} moved to {new}" in w], seen["warnings"]
        assert all(w.startswith("KspipeDeprecationWarning") for w in seen["warnings"])


def test_the_old_guides_start_from_is_the_api_one_and_its_warning_points_at_the_line():
    script = "from kspipe.incremental import start_from\nimport kspipe.api\n" + (
        "assert start_from is kspipe.api.start_from\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # shown without -W (kspipe turns its own deprecations on), at the importing line
    assert result.stderr.startswith("<string>:1: KspipeDeprecationWarning: kspipe.incremental"), (
        result.stderr
    )
    assert "kspipe.api" in result.stderr


def test_the_version_is_one_number_and_the_changelog_describes_it():
    # the [project] table's version (tomllib is Python 3.11's; kspipe runs on 3.10 too)
    (version,) = re.findall(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version == kspipe.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## (\d+\.\d+\.\d+)", changelog, re.M)
    assert versions and versions[0] == kspipe.__version__, versions
    assert f"kspipe {kspipe.REMOVED_IN}" in changelog  # when the old names go
