"""Hydra's flags (``--cfg``, ``--info``, ``--resolve``, ``--help``, ``-m``, ``-c``) anywhere on
the command line, with a plugin that adds a config folder installed, and what they show: the
user's config as Hydra would, without anything kspipe adds to the command line."""

from pathlib import Path

import pytest
import yaml

from kspipe.testing import assert_one_line_error, install_plugin, plugin_env, run_kspipe

CLASSIFIER = (
    Path(__file__).resolve().parents[2] / "plugins" / "kspipe-classifier" / "kspipe_classifier"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of a command with the example classifier installed: it adds its
    config folder (``pkg://kspipe_classifier.conf``) to Hydra's search path."""
    site = tmp_path_factory.mktemp("site")
    install_plugin(site, CLASSIFIER, "classifier = kspipe_classifier.plugin")
    return plugin_env(site)


@pytest.mark.parametrize(
    "args",
    [
        ["+experiment=omniglot_5way", "--cfg", "job", "train.meta_iters=7"],
        ["--cfg", "job", "+experiment=omniglot_5way", "train.meta_iters=7"],
        ["+experiment=omniglot_5way", "-c", "job", "--resolve", "train.meta_iters=7"],
    ],
)
def test_cfg_job_anywhere_on_the_line_with_a_plugins_config_folder(tmp_path, env, args):
    result = run_kspipe(*args, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = yaml.safe_load(result.stdout)
    assert shown["train"]["meta_iters"] == 7 and "hydra" not in shown
    assert list(tmp_path.iterdir()) == []  # printed, nothing made


def test_info_and_a_plugins_experiment(tmp_path, env):
    """``--info`` before or after the overrides; the plugin's config folder is on the search
    path (its experiment composes)."""
    searchpath = run_kspipe(
        "+experiment=blobs", "--info", "searchpath", cwd=tmp_path, env=env, timeout=120
    )
    assert searchpath.returncode == 0, searchpath.stderr[-3000:]
    assert "pkg://kspipe_classifier.conf" in searchpath.stdout
    config = run_kspipe("--info", "+experiment=blobs", cwd=tmp_path, env=env, timeout=120)
    assert config.returncode == 0, config.stderr[-3000:]
    assert "classifier" in config.stdout and "Defaults Tree" in config.stdout


def test_cfg_hydra_shows_the_users_overrides_alone(tmp_path, env):
    """A search's Hydra config: kspipe's defaults for it (maximise, go on past failed
    trials) are the config's values, not overrides the user seems to have typed; the
    plugins' folders are the config's search path, not an override either."""
    result = run_kspipe(
        "hydra/sweeper=optuna",
        "--cfg",
        "hydra",
        "train.meta_iters=2",
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    hydra = yaml.safe_load(result.stdout)["hydra"]
    assert hydra["overrides"] == {"hydra": ["hydra/sweeper=optuna"], "task": ["train.meta_iters=2"]}
    assert hydra["sweeper"]["direction"] == "maximize"
    assert hydra["sweeper"]["max_failure_rate"] == 1.0
    mine = run_kspipe(
        "hydra/sweeper=optuna",
        "hydra.sweeper.direction=minimize",
        "--cfg",
        "hydra",
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert yaml.safe_load(mine.stdout)["hydra"]["sweeper"]["direction"] == "minimize"
    resolved = run_kspipe("--cfg", "hydra", "--resolve", cwd=tmp_path, env=env, timeout=120)
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    assert yaml.safe_load(resolved.stdout)["hydra"]["searchpath"] == [
        "pkg://kspipe_classifier.conf"
    ]


def test_the_command_line_as_hydras_parser_reads_it_whole():
    """Overrides after a flag are read with the others; ``--info`` takes the next argument
    only if it is one of its choices."""
    from kspipe.cli.arguments import hydra_arguments, runs_a_job

    parsed, unknown = hydra_arguments(["workers=2", "-m", "mode=local,pserver", "--cfg=job"])
    assert parsed.overrides == ["workers=2", "mode=local,pserver"] and unknown == []
    assert parsed.multirun and parsed.cfg == "job"
    parsed, _ = hydra_arguments(["--info", "+experiment=x", "-i", "defaults"])
    assert parsed.overrides == ["+experiment=x"] and parsed.info == "defaults"
    assert not runs_a_job(["workers=2", "--cfg=job"]) and runs_a_job(["workers=2", "-m"])


def test_two_flags_hydra_takes_one_at_a_time_are_one_line(tmp_path):
    assert_one_line_error(
        run_kspipe("-m", "workers=1,2", "--cfg", "job", cwd=tmp_path, timeout=120),
        "-m and --cfg together",
    )
