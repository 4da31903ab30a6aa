"""The config validates itself: each group's dataclass (kspipe.config.schema's, and the owners'
config.py, which the built-in plugins declare through ``kspipe_config_schemas`` as installed
plugins do) refuses a misspelt key or a value of the wrong type, in one line, while the root
stays open to the groups of third-party plugins; the defaults are those config.yaml had."""

from pathlib import Path

import pytest

from kspipe.errors import ConfigError
from kspipe.testing import compose_config, run_kspipe

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "train.meta_iter=5",
            "train.meta_iter=5: train has no key 'meta_iter' (did you mean train.meta_iters?)",
        ),
        ("train.meta_iters=abc", "train.meta_iters=abc: must be an integer"),
        ("eval.baseline=maybe", "eval.baseline=maybe: must be true or false"),
    ],
)
def test_the_command_line_refuses_a_bad_key_or_type_in_one_line(tmp_path, override, line):
    result = run_kspipe("+experiment=omniglot_5way", override, cwd=tmp_path, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"kspipe: error: {line}"], result.stderr
    assert "Traceback" not in result.stderr


def test_each_value_of_a_sweep_is_checked_before_any_job_runs(tmp_path):
    result = run_kspipe(
        "-m", "+experiment=omniglot_5way", "train.meta_iters=1,abc", cwd=tmp_path, timeout=300
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kspipe: error: train.meta_iters=abc: must be an integer"
    ], result.stderr
    assert not (tmp_path / "multirun").exists()


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["train.meta_iter=5"], "train.meta_iter=5: train has no key 'meta_iter'"),
        (["+train.meta_iter=5"], "+train.meta_iter=5: train has no key 'meta_iter'"),
        (
            ["dataset.embeded.seed=1"],
            "dataset has no key 'embeded' (did you mean dataset.embedded?)",
        ),
        (["train.meta_iters=abc"], "train.meta_iters=abc: must be an integer"),
        (["train.inner_lr=fast"], "train.inner_lr=fast: must be a number"),
        (["ctr.hidden=[64,wide]"], "ctr.hidden=[64,wide]: ctr.hidden[1] must be an integer"),
        (["cluster.timeout_s=soon"], "cluster.timeout_s=soon: must be a number"),
        (["mode=null"], "mode=null: must not be null"),
        (["seed=x"], "seed=x: must be an integer"),
        (["nothere=1"], "nothere=1: no such key"),
    ],
)
def test_compose_refuses_a_bad_key_or_type_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as refused:
        compose_config(overrides)
    message = str(refused.value)
    assert fragment in message and "\n" not in message, message


def test_a_mistake_in_an_experiment_file_names_the_file(tmp_path):
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "typo.yaml").write_text("# @package _global_\ntrain: {meta_iter: 5}\n")
    with pytest.raises(ConfigError, match=r"train has no key 'meta_iter'.*\(in experiment/typo\)"):
        compose_config(["+experiment=typo"], config_dirs=[f"file://{tmp_path}"])


def test_values_that_may_take_several_types_stay_legal():
    cfg = compose_config(
        [
            "workers='10.0.0.1:7001,10.0.0.2:7001'",
            "servers=2",
            "devices=[0,1]",
            "datafeed.train_files=[a,b]",
            "datafeed.test_files=logs/test",
            "++compile.build_strategy={fuse_elewise_add_act_ops: true}",
        ]
    )
    assert cfg.workers == "10.0.0.1:7001,10.0.0.2:7001" and cfg.servers == 2
    assert list(cfg.devices) == [0, 1] and list(cfg.datafeed.train_files) == ["a", "b"]
    assert cfg.compile.build_strategy.fuse_elewise_add_act_ops is True
    assert compose_config(["devices='0,1'"]).devices == "0,1"


@pytest.mark.parametrize(
    "plugin, experiment, key",
    [
        ("kspipe-shapes", "shapes_5way", "shapes"),
        ("kspipe-classifier", "blobs", "classifier"),
    ],
)
def test_a_plugin_experiment_adds_a_top_level_key_of_its_own(monkeypatch, plugin, experiment, key):
    """With a schema of its own (the classifier's) or without one (shapes': an open key)."""
    import importlib

    monkeypatch.syspath_prepend(str(PLUGINS / plugin))
    package = plugin.replace("-", "_")
    schemas = (
        importlib.import_module(f"{package}.plugin").kspipe_config_schemas()
        if key == "classifier"
        else None
    )
    cfg = compose_config(
        [f"+experiment={experiment}", f"{key}.seed=3"],
        config_dirs=[f"pkg://{package}.conf"],
        schemas=schemas,
    )
    assert cfg[key].seed == 3
    with pytest.raises(ConfigError, match="train has no key 'meta_iter'"):
        compose_config(
            [f"+experiment={experiment}", "train.meta_iter=3"],
            config_dirs=[f"pkg://{package}.conf"],
            schemas=schemas,
        )


def test_the_defaults_are_those_of_the_old_config_yaml():
    cfg = compose_config([])
    assert (cfg.mode, cfg.workers, cfg.servers, cfg.devices, cfg.seed) == ("local", 1, 1, None, 0)
    assert (cfg.resume, cfg.run_dir, cfg.isolate) == (None, None, None)
    assert cfg.dataset.name == "omniglot" and cfg.dataset.train_characters == 1200
    assert cfg.dataset.embedded.characters == 1623 and cfg.dataset.embedded.drawers == 20
    assert (cfg.task.ways, cfg.task.shots) == (5, 5)
    assert (cfg.model.layers, cfg.model.filters, cfg.model.stride, cfg.model.pool) == (
        4,
        64,
        2,
        False,
    )
    assert (
        cfg.train.meta_iters,
        cfg.train.inner_lr,
        cfg.train.meta_step_final,
        cfg.train.checkpoint_every,
        cfg.train.keep_checkpoints,
    ) == (1000, 0.001, 0.0, 100, 2)
    assert (cfg.eval.tasks, cfg.eval.inner_iters, cfg.eval.baseline, cfg.eval.interval_tasks) == (
        200,
        50,
        True,
        10,
    )
    assert list(cfg.datafeed.fetch) == ["loss"] and cfg.datafeed.train_files is None
    assert (cfg.datafeed.threads, cfg.datafeed.print_period_s) == (2, 5)
    assert cfg.datafeed.generated.lines_per_file == 5000
    assert list(cfg.ctr.hidden) == [64, 32] and cfg.ctr.hash_size == 262144
    assert (cfg.cluster.strategy, cfg.cluster.wait_push, cfg.cluster.timeout_s) == (
        "async",
        False,
        None,
    )
    assert cfg.compile.onednn_conv is True and dict(cfg.compile.build_strategy) == {}
    assert dict(cfg.stages) == {
        "role": "local",
        "dataset": "open_ks",
        "program": "reptile",
        "compile": "reptile",
        "execute": "reptile",
        "save": "reptile",
    }
    assert compose_config(["mode=pserver", "stages.program=ctr"]).stages.save == "ctr"
    assert (cfg.tracking.enabled, cfg.tracking.experiment, cfg.tracking.uri) == (
        True,
        "kspipe",
        None,
    )


def test_the_groups_are_in_the_order_config_yaml_had():
    assert list(compose_config([])) == [
        "mode",
        "workers",
        "servers",
        "devices",
        "seed",
        "resume",
        "evaluate",
        "init_from",
        "run_dir",
        "isolate",
        "dataset",
        "task",
        "model",
        "train",
        "eval",
        "datafeed",
        "ctr",
        "cluster",
        "compile",
        "stages",
        "tracking",
    ]


def test_registering_the_schemas_again_changes_nothing():
    from kspipe.config.schema import register_schemas

    before = compose_config(["train.meta_iters=7"])
    register_schemas()
    register_schemas()
    assert compose_config(["train.meta_iters=7"]) == before


def test_a_worker_loads_the_resolved_config_as_plain_yaml(tmp_path):
    from omegaconf import OmegaConf

    cfg = compose_config(["mode=pserver", "workers=2"])
    OmegaConf.save(
        OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), tmp_path / "job.yaml"
    )
    loaded = OmegaConf.load(tmp_path / "job.yaml")  # as kspipe.cli.worker does
    assert loaded == OmegaConf.to_container(cfg, resolve=True)
    assert loaded.stages.role == "pserver" and loaded.datafeed.print_period_s == 5
