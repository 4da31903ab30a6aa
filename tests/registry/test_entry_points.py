"""Installed plugins: loaded through the ``kspipe`` entry-point group (not when autoload is
off), never in place of a built-in or an earlier plugin of the same name, listed by
``kspipe plugins`` with their package and the hooks each serves; a plugin package
pip-installed as a user installs it is found and runs."""

import re
import shutil
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest
from mlflow import MlflowClient

from kspipe.registry.plugin_manager import builtin_plugins, get_plugin_manager
from kspipe.testing import begun_store, install_plugin, plugin_env, run_kspipe

REPO = Path(__file__).resolve().parents[2]
TEST_PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def fake_distribution(package: str, entry_points: dict):
    """A distribution named ``package`` whose ``kspipe`` entry points are ``entry_points``."""
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())

    class FakeDist(metadata.Distribution):
        def read_text(self, filename):
            if filename == "METADATA":
                return f"Name: {package}\nVersion: 1.0\n"
            if filename == "entry_points.txt":
                return "[kspipe]\n" + lines
            return None

        def locate_file(self, path):
            return path

    return FakeDist()


def fake_plugin(monkeypatch, module_name: str) -> types.ModuleType:
    """A plugin module ``module_name`` (importable for the test) whose
    ``kspipe_config_dirs`` names it."""
    module = types.ModuleType(module_name)
    exec(
        "from kspipe import hookimpl\n"
        "@hookimpl\n"
        "def kspipe_config_dirs():\n"
        f"    return ['pkg://{module_name}']\n",
        module.__dict__,
    )
    monkeypatch.setitem(sys.modules, module_name, module)
    return module


def test_installed_plugins_load_from_the_entry_point_group(monkeypatch):
    module = fake_plugin(monkeypatch, "kspipe_fake_plugin")
    dist = fake_distribution("kspipe-fake", {"fake": "kspipe_fake_plugin"})
    monkeypatch.setattr(metadata, "distributions", lambda **kw: iter([dist]))
    pm = get_plugin_manager(load_entrypoints=True)
    assert pm.get_plugin("fake") is module
    assert ["pkg://kspipe_fake_plugin"] in pm.hook.kspipe_config_dirs()
    monkeypatch.setenv("KSPIPE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert get_plugin_manager().get_plugin("fake") is None


@pytest.mark.parametrize("name", ["reptile", "collective", "mlflow"])
def test_an_installed_plugin_with_a_builtin_name_is_not_loaded_and_warned_of(
    monkeypatch, capsys, name
):
    collider = fake_plugin(monkeypatch, "kspipe_fake_collider")
    newcomer = fake_plugin(monkeypatch, "kspipe_fake_newcomer")
    dist = fake_distribution(
        "kspipe-collider", {name: "kspipe_fake_collider", "newcomer": "kspipe_fake_newcomer"}
    )
    monkeypatch.setattr(metadata, "distributions", lambda **kw: iter([dist]))

    pm = get_plugin_manager(load_entrypoints=True)

    builtin = dict(builtin_plugins())[name]
    assert type(pm.get_plugin(name)) is type(builtin)  # still the built-in
    if isinstance(builtin, types.ModuleType):
        assert pm.get_plugin(name) is builtin
    assert not pm.is_registered(collider)
    assert ["pkg://kspipe_fake_collider"] not in pm.hook.kspipe_config_dirs()
    assert pm.get_plugin("newcomer") is newcomer  # the package's other plugin loads
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert lines == [
        f"kspipe: warning: the installed plugin {name!r} of kspipe-collider is "
        f"not loaded: a built-in or earlier plugin has that name; rename its "
        f"entry point"
    ]


def test_a_second_package_with_a_taken_name_is_not_loaded(monkeypatch, capsys):
    first = fake_plugin(monkeypatch, "kspipe_fake_first")
    second = fake_plugin(monkeypatch, "kspipe_fake_second")
    dists = [
        fake_distribution("kspipe-first", {"blobs": "kspipe_fake_first"}),
        fake_distribution("kspipe-second", {"blobs": "kspipe_fake_second"}),
    ]
    monkeypatch.setattr(metadata, "distributions", lambda **kw: iter(dists))

    pm = get_plugin_manager(load_entrypoints=True)

    assert pm.get_plugin("blobs") is first
    assert not pm.is_registered(second)
    assert "the installed plugin 'blobs' of kspipe-second is not loaded" in capsys.readouterr().err


def test_plugins_lists_built_ins_and_installed_plugins_with_their_hooks(tmp_path):
    """Built-ins with the stage each serves; an installed launcher (the tests' relay) with
    its package and the ``cluster.launcher`` value it adds."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, TEST_PLUGINS / "relay" / "kspipe_relay", "relay = kspipe_relay.plugin")
    result = run_kspipe("plugins", cwd=tmp_path, env=plugin_env(site), timeout=120)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert {"local", "pserver", "collective", "open_ks", "reptile", "mlflow"} <= set(lines)
    assert "kspipe_read_dataset [stage dataset]" in lines["open_ks"]
    assert "kspipe-relay 0.1.0" in lines["relay"]
    assert "kspipe_process_launchers [cluster.launcher=relay]" in lines["relay"]


def test_an_installed_plugin_package_is_found_and_runs(tmp_path, tiny_data):
    site, source = tmp_path / "site", tmp_path / "src" / "kspipe-shapes"
    # from a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(
        REPO / "plugins" / "kspipe-shapes",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        timeout=600,
    )
    env = plugin_env(site)
    listing = run_kspipe("plugins", cwd=tmp_path, env=env, timeout=120)
    shapes = [line for line in listing.stdout.splitlines() if line.startswith("shapes")]
    version = re.search(r'^version = "(.+)"', (source / "pyproject.toml").read_text(), re.M)[1]
    assert shapes and f"kspipe-shapes {version}" in shapes[0]
    assert "kspipe_read_dataset" in shapes[0]
    helped = run_kspipe(
        "+experiment=shapes_5way", "shapes.classes=30", "--help", cwd=tmp_path, env=env, timeout=120
    )
    assert helped.returncode == 0, helped.stderr
    experiments = next(
        line for line in helped.stdout.splitlines() if line.startswith("experiments")
    )
    assert "shapes_5way" in experiments and "omniglot_5way" in experiments
    assert "shapes:\n  classes: 30\n" in helped.stdout  # the plugin's schema, composed
    result = run_kspipe(
        "+experiment=shapes_5way",
        f"run_dir={tmp_path / 'run'}",
        f"tracking.uri={begun_store(tmp_path)}",
        "train.meta_iters=4",
        "eval.tasks=3",
        "eval.interval=2",
        "shapes.classes=30",
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    assert run.data.params["stages.dataset"] == "shapes"
    env["KSPIPE_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    off = run_kspipe("plugins", cwd=tmp_path, env=env, timeout=120)
    assert "shapes" not in off.stdout
