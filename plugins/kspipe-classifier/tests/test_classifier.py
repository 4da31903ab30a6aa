"""The example workload plugin, installed as a user installs a plugin, trains in every
mode, and the modes really exchange: collective workers=2 and parameter servers with the
sync strategy end with the model one process trains on the whole batches."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kspipe.api import ConfigError, assert_one_line_error, compose_config, plugin_env, run_kspipe

PLUGIN = Path(__file__).resolve().parents[1]

# The accuracy the tests state: the blobs overlap a little, so ~0.97 is what a trained MLP
# reaches and a model that never trained scores ~0.25 (4 classes).
STATED_ACCURACY = 0.9
SMALL = ["classifier.train_points=2048", "classifier.epochs=2", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The plugin pip-installed into a folder of its own, found through its entry point."""
    site, source = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("src") / "plugin"
    # from a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(
        PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
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
    return plugin_env(site)


def kspipe(env, cwd, *args):
    return run_kspipe(*args, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def runs(installed, tmp_path_factory):
    """One run in each mode; {mode: run folder}."""
    out = {}
    for mode, extra in (
        ("local", []),
        ("collective", ["workers=2"]),
        ("pserver", ["workers=2", "cluster.strategy=sync"]),
    ):
        folder = tmp_path_factory.mktemp(mode)
        result = kspipe(
            installed,
            folder,
            "+experiment=blobs",
            f"mode={mode}",
            *extra,
            *SMALL,
            f"run_dir={folder / 'run'}",
        )
        assert result.returncode == 0, (mode, result.stderr[-3000:])
        assert "kspipe: done: test_accuracy" in result.stdout
        out[mode] = folder / "run"
    return out


def logits(run_dir, x):
    import paddle

    paddle.enable_static()
    exe = paddle.static.Executor(paddle.CPUPlace())
    scope = paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        program, feeds, fetches = paddle.static.load_inference_model(
            str(run_dir / "inference_model" / "model"), exe
        )
        (out,) = exe.run(program, feed={feeds[0]: x}, fetch_list=fetches)
    return np.asarray(out)


@pytest.mark.parametrize("mode", ["local", "collective", "pserver"])
def test_the_workload_trains_to_the_stated_accuracy(runs, mode):
    metrics = json.loads((runs[mode] / "metrics.json").read_text())
    assert metrics["test_accuracy"] >= STATED_ACCURACY, metrics
    assert metrics["samples_per_s"] > 0


@pytest.mark.parametrize("mode", ["collective", "pserver"])
def test_two_workers_end_with_the_one_process_model(runs, mode):
    # each worker took half of every batch; the all-reduced gradients (collective) or the
    # mean change on the servers (sync) make it the step of the whole batch
    x = np.random.default_rng(5).normal(0, 3, (64, 8)).astype(np.float32)
    np.testing.assert_allclose(
        logits(runs[mode], x), logits(runs["local"], x), rtol=1e-4, atol=1e-4
    )


def test_plugins_lists_the_workload(installed, tmp_path):
    listing = subprocess.run(
        [sys.executable, "-m", "kspipe.cli.command", "plugins"],
        cwd=tmp_path,
        env=installed,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(line for line in listing.stdout.splitlines() if line.startswith("classifier"))
    (version,) = re.findall(r'^version = "(.+)"', (PLUGIN / "pyproject.toml").read_text(), re.M)
    assert f"kspipe-classifier {version}" in line and "kspipe_execute [stage execute]" in line


def test_a_batch_that_does_not_divide_among_workers_is_one_line(installed, tmp_path):
    """Refused by the plugin's kspipe_check_config, before any process of the job starts."""
    result = kspipe(
        installed,
        tmp_path,
        "+experiment=blobs",
        "mode=collective",
        "workers=3",
        *SMALL,
        "classifier.batch_size=64",
        f"run_dir={tmp_path / 'run'}",
    )
    assert_one_line_error(result)
    assert result.stderr.strip().splitlines() == [
        "kspipe: error: classifier.batch_size=64 must divide among the 3 workers "
        "(each takes an equal slice of every batch)"
    ], result.stderr
    # Hydra's own files only: no job.yaml, no logs/, no process started
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra"]


@pytest.mark.parametrize(
    "overrides, workers",
    [
        (["mode=collective", "workers=3"], 3),
        (["mode=pserver", "workers=[127.0.0.1:7001,127.0.0.1:7002]"], 2),
    ],
)
def test_the_batch_split_is_checked_with_the_config(overrides, workers):
    from kspipe_classifier import plugin

    def check(*given):
        cfg = compose_config(
            ["+experiment=blobs", *given],
            config_dirs=plugin.kspipe_config_dirs(),
            schemas=plugin.kspipe_config_schemas(),
        )
        plugin.kspipe_check_config(cfg=cfg)

    with pytest.raises(ConfigError) as refused:
        check(*overrides, "classifier.batch_size=65")
    assert str(refused.value) == (
        f"classifier.batch_size=65 must divide among the {workers} workers "
        "(each takes an equal slice of every batch)"
    )
    check(*overrides, f"classifier.batch_size={workers * 20}")
    check("mode=local", "workers=3", "classifier.batch_size=65")  # one process takes it all


def test_a_misspelt_key_or_a_wrong_type_is_one_line(installed, tmp_path):
    """The plugin's schema (ClassifierConfig) checks its group as kspipe's own are."""
    for override, line in (
        (
            "classifier.batch_sise=32",
            "kspipe: error: classifier.batch_sise=32: classifier "
            "has no key 'batch_sise' (did you mean "
            "classifier.batch_size?)",
        ),
        ("classifier.epochs=two", "kspipe: error: classifier.epochs=two: must be an integer"),
    ):
        result = kspipe(installed, tmp_path, "+experiment=blobs", override, *SMALL)
        assert result.returncode != 0
        assert result.stderr.strip().splitlines() == [line], result.stderr


def test_the_data_set_names_itself_with_the_digest_of_its_arrays():
    """What the run's record shows as its input: the same for the same settings, another
    for another seed."""
    import hashlib

    from kspipe_classifier.plugin import ClassifierConfig, kspipe_read_dataset
    from omegaconf import OmegaConf

    from kspipe.api import Role

    def read(seed):
        config = ClassifierConfig(train_points=64, test_points=16, seed=seed)
        return kspipe_read_dataset(cfg=OmegaConf.create({"classifier": config}), role=Role())

    blobs = read(0)
    arrays = (blobs.train_x, blobs.train_y, blobs.test_x, blobs.test_y)
    digest = hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()[:8]
    assert blobs.training_data.digest == digest
    assert blobs.training_data.name == "blobs"
    assert blobs.training_data.source == "kspipe-classifier: generated from classifier.seed=0"
    assert blobs.training_data.profile == {"train_points": 64, "test_points": 16}
    assert read(0).training_data == blobs.training_data
    assert read(1).training_data.digest != digest
