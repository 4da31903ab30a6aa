"""The runs that several files here compare with, each made once a session:

* the tiny job of ``tests.kit.SCHEDULED_JOB`` started by kspipe's own launcher, its
  collective form, and a longer form of it to stop midway: the weights that every other
  way of starting, stopping and resuming the same job must reach;
* runs of the tests' workload plugin (tests/plugins/bags), installed with the tests'
  process launcher (tests/plugins/relay) as a user installs plugins."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kspipe.testing import install_plugin, plugin_env, run_kspipe
from tests.kit import SCHEDULED_COLLECTIVE, latest_weights, scheduled_overrides

TEST_PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def launch(tmp: Path, data: Path, *overrides) -> Path:
    """The scheduled job with ``overrides`` run by kspipe's own launcher in ``tmp/run``."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            *scheduled_overrides(tmp, data),
            *overrides,
            f"run_dir={tmp / 'run'}",
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="session")
def launched(tmp_path_factory, tiny_data):
    """The tiny scheduled job trained by kspipe's own launcher: its final weights, which
    every other way of starting the same job must reach bit for bit."""
    return latest_weights(launch(tmp_path_factory.mktemp("launched"), tiny_data))


@pytest.fixture(scope="session")
def launched_collective(tmp_path_factory, tiny_data):
    """The scheduled job's collective form (``SCHEDULED_COLLECTIVE``) trained by kspipe's
    own launcher: the reference weights of its other launchers."""
    return latest_weights(
        launch(tmp_path_factory.mktemp("launched-collective"), tiny_data, *SCHEDULED_COLLECTIVE)
    )


#: The scheduled job made long enough to stop midway: 40 meta-iterations, a checkpoint every
#: 4 (the newest 2 kept: a job stopped and resumed midway prunes the checkpoint it resumed
#: from long before its end), no evaluation before the last.
LONG_ITERATIONS, LONG_EVERY, LONG_KEEP = 40, 4, 2
LONG = [
    f"train.meta_iters={LONG_ITERATIONS}",
    f"train.checkpoint_every={LONG_EVERY}",
    f"train.keep_checkpoints={LONG_KEEP}",
    "eval.interval=0",
    "eval.baseline=false",
]


@pytest.fixture(scope="session")
def launched_long(tmp_path_factory, tiny_data):
    """The scheduled job with ``.overrides`` (after ``scheduled_overrides``: ``.iterations``
    meta-iterations, a checkpoint every ``.every``) trained uninterrupted by kspipe's own
    launcher; ``.weights``: its final checkpoint's, which the same job stopped and resumed
    (SIGTERM, a requeued Slurm job) must reach."""
    run = launch(tmp_path_factory.mktemp("launched-long"), tiny_data, *LONG)
    return SimpleNamespace(
        overrides=list(LONG),
        iterations=LONG_ITERATIONS,
        every=LONG_EVERY,
        keep=LONG_KEEP,
        weights=latest_weights(run),
    )


@pytest.fixture(scope="session")
def unreadable_data(tmp_path_factory, tiny_data) -> Path:
    """``tiny_data``'s folders with every image's bytes garbage: a layout the command's
    checks accept before the job starts, and data only a worker finds it cannot read."""
    copy = tmp_path_factory.mktemp("unreadable") / "data"
    shutil.copytree(tiny_data, copy)
    for image in copy.rglob("*.png"):
        image.write_bytes(b"not an image")
    return copy


@pytest.fixture(scope="session")
def bags_env(tmp_path_factory):
    """The environment of a ``kspipe`` command that loads the tests' workload (``bags``)
    and process launcher (``relay``), installed through their entry points."""
    site = tmp_path_factory.mktemp("site")
    install_plugin(site, TEST_PLUGINS / "relay" / "kspipe_relay", "relay = kspipe_relay.plugin")
    install_plugin(site, TEST_PLUGINS / "bags" / "kspipe_bags", "bags = kspipe_bags.plugin")
    return plugin_env(site)


@pytest.fixture(scope="session")
def bags_run(bags_env, tmp_path_factory):
    """``bags_run(name, *overrides)`` -> ``(metrics, parameters)`` of ``kspipe
    +experiment=bags tracking.enabled=false <overrides>``, run once a session per name (a
    name always with the same overrides); ``bags_run.folders[name]``: its run folder."""
    done, folders = {}, {}

    def run(name, *overrides):
        if name in done:
            assert done[name][0] == overrides, (name, overrides, "was run with", done[name][0])
        else:
            folder = tmp_path_factory.mktemp(name)
            folders[name] = folder / "run"
            result = run_kspipe(
                "+experiment=bags",
                "tracking.enabled=false",
                *overrides,
                f"run_dir={folder / 'run'}",
                cwd=folder,
                env=bags_env,
            )
            assert result.returncode == 0, (name, result.stderr[-3000:])
            metrics = json.loads((folder / "run" / "metrics.json").read_text())
            done[name] = overrides, (metrics, dict(np.load(folder / "run" / "params.npz")))
        return done[name][1]

    run.folders = folders
    return run


@pytest.fixture
def summers():
    """The summers started in a test; each ends as its server would (stdin closed)."""
    started: list = []
    yield started
    for process in started:
        if process is not None:
            process.stdin.close()
            process.wait(timeout=30)
