"""The config validates itself: each group's dataclass (kspipe.schema's, and the owners'
config.py, which the built-in plugins declare through ``kspipe_config_schemas`` as installed
plugins do) refuses a misspelt key or a value of the wrong type, in one line, while the root
stays open to the groups of third-party plugins; the defaults are those config.yaml had."""

from pathlib import Path

import pytest

from kspipe.errors import ConfigError
from kspipe.testing import compose_config, run_kspipe

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
TEST_PLUGINS = Path(__file__).resolve().parents[1] / "plugins"  # the tests' own plugins


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
    from kspipe.schema import register_schemas

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


@pytest.fixture
def bags(monkeypatch):
    """The tests' workload plugin (tests/plugins/bags), whose group ``bags`` has a schema:
    ``compose(overrides)`` composes with its config folder and schema."""
    monkeypatch.syspath_prepend(str(TEST_PLUGINS / "bags"))
    from kspipe_bags.plugin import BagsConfig

    def compose(*overrides):
        return compose_config(
            ["+experiment=bags", *overrides], ["pkg://kspipe_bags.conf"], {"bags": BagsConfig}
        )

    return compose


def test_a_plugins_group_has_its_schemas_defaults_and_checks(bags):
    cfg = bags("bags.learning_rate=0.25")
    assert cfg.bags.learning_rate == 0.25 and cfg.bags.batch_size == 64  # the default
    for override, line in (
        (
            "bags.batch_sise=32",
            "bags.batch_sise=32: bags has no key 'batch_sise' (did you mean bags.batch_size?)",
        ),
        (
            "+bags.batch_sise=32",
            "+bags.batch_sise=32: bags has no key 'batch_sise' (did you mean bags.batch_size?)",
        ),
        ("bags.batch_size=abc", "bags.batch_size=abc: must be an integer"),
    ):
        with pytest.raises(ConfigError) as err:
            bags(override)
        assert str(err.value) == line


@pytest.mark.parametrize("group", ["train", "cluster"])
def test_a_plugin_cannot_take_a_group_of_kspipes(group):
    """Nor add keys to one: only the built-in plugins share ``cluster``."""
    from dataclasses import dataclass

    @dataclass
    class Extra:
        steps: int = 1

    with pytest.raises(
        ConfigError, match=f"a plugin declares the config group '{group}', which is kspipe's own"
    ):
        compose_config([], schemas={group: Extra})


def test_the_built_in_plugins_declare_kspipes_groups_through_the_hook():
    """As installed plugins declare theirs; ``cluster`` is declared by the modes (their
    keys) and by the launchers (theirs)."""
    from kspipe.launchers.config import LauncherConfig
    from kspipe.modes.config import ModeConfig
    from kspipe.plugin_manager import get_plugin_manager

    owners: dict = {}
    for impl in get_plugin_manager(
        load_entrypoints=False
    ).hook.kspipe_config_schemas.get_hookimpls():
        for group, schema in impl.function().items():
            owners.setdefault(group, {})[impl.plugin_name] = schema
    assert {group: sorted(by) for group, by in owners.items()} == {
        "dataset": ["open_ks"],
        "task": ["reptile"],
        "model": ["reptile"],
        "train": ["reptile"],
        "eval": ["reptile"],
        "datafeed": ["datafeed"],
        "ctr": ["ctr"],
        "cluster": ["collective", "processes", "pserver"],
    }
    assert owners["cluster"] == {
        "pserver": ModeConfig,
        "collective": ModeConfig,
        "processes": LauncherConfig,
    }


CLUSTER_KEYS = (
    "strategy, k_steps, wait_push, shard_sum, host, threads, timeout_s, control_port, "
    "hosts_timeout_s, stall_seconds, secret_file, job_id, launcher, max_restarts, slurm_args, image"
)


def test_the_cluster_group_is_the_modes_keys_then_the_launchers():
    cluster = compose_config([]).cluster
    assert ", ".join(cluster) == CLUSTER_KEYS
    assert dict(cluster) == {
        "strategy": "async",
        "k_steps": 1,
        "wait_push": False,
        "shard_sum": True,
        "host": None,
        "threads": None,
        "timeout_s": None,
        "control_port": None,
        "hosts_timeout_s": 300.0,
        "stall_seconds": 600.0,
        "secret_file": None,
        "job_id": None,
        "launcher": "processes",
        "max_restarts": 0,
        "slurm_args": [],
        "image": None,
    }
    cluster = compose_config(
        ["cluster.strategy=sync", "cluster.launcher=slurm", "cluster.slurm_args=['--time=10']"]
    ).cluster
    assert (cluster.strategy, cluster.launcher, list(cluster.slurm_args)) == (
        "sync",
        "slurm",
        ["--time=10"],
    )


@pytest.mark.parametrize(
    "override, line",
    [
        ("cluster.nope=1", f"cluster.nope=1: cluster has no key 'nope' (its keys: {CLUSTER_KEYS})"),
        (
            "+cluster.imag=x",
            "+cluster.imag=x: cluster has no key 'imag' (did you mean cluster.image?)",
        ),
        ("cluster.k_steps=abc", "cluster.k_steps=abc: must be an integer"),
        ("cluster.hosts_timeout_s=soon", "cluster.hosts_timeout_s=soon: must be a number"),
        (
            "cluster.slurm_args=x",
            "cluster.slurm_args=x: Invalid value assigned: str is not a ListConfig, list or tuple.",
        ),
    ],
)
def test_either_part_of_the_cluster_group_refuses_a_mistake_in_one_line(override, line):
    with pytest.raises(ConfigError) as refused:
        compose_config([override])
    assert str(refused.value) == line


def test_installed_plugins_may_share_a_group_each_with_keys_of_its_own():
    from dataclasses import dataclass

    from kspipe import hookimpl
    from kspipe.plugin_manager import plugin_schemas
    from kspipe.testing import plugin_manager

    @dataclass
    class Reader:
        files: str = "data/*.txt"

    @dataclass
    class Writer:
        folder: str = "out"

    @dataclass
    class Other:
        files: int = 1

    class Declares:
        def __init__(self, schema):
            self.schema = schema

        @hookimpl
        def kspipe_config_schemas(self):
            return {"store": self.schema}

    schemas = plugin_schemas(
        plugin_manager(("reader", Declares(Reader)), ("writer", Declares(Writer)))
    )
    store = compose_config(["store.folder=elsewhere"], schemas=schemas).store
    assert list(store) == ["files", "folder"]
    assert (store.files, store.folder) == ("data/*.txt", "elsewhere")
    with pytest.raises(ConfigError) as refused:
        compose_config(["store.fles=x"], schemas=schemas)
    assert str(refused.value) == (
        "store.fles=x: store has no key 'fles' (did you mean store.files?)"
    )
    schemas = plugin_schemas(
        plugin_manager(("reader", Declares(Reader)), ("other", Declares(Other)))
    )
    with pytest.raises(
        ConfigError,
        match=r"^two plugins declare the key store\.files of "
        r"their config group \(.*Reader and .*Other\)$",
    ):
        compose_config([], schemas=schemas)


def test_a_plugins_key_named_like_a_method_of_the_config_is_one_line():
    """``cfg.<group>.items`` would be DictConfig's method, not the value: a plugin's schema
    with such a key, or one given on the command line, is refused while composing."""
    from dataclasses import dataclass

    from kspipe import hookimpl
    from kspipe.plugin_manager import plugin_schemas
    from kspipe.testing import plugin_manager

    @dataclass
    class Basket:
        items: int = 3
        epochs: int = 2

    class Declares:
        @hookimpl
        def kspipe_config_schemas(self):
            return {"basket": Basket}

    schemas = plugin_schemas(plugin_manager(("basket", Declares())))
    with pytest.raises(ConfigError) as refused:
        compose_config(["+experiment=omniglot_5way"], schemas=schemas)
    assert str(refused.value) == (
        "basket.items: 'items' is the name of a method of the config object (reading "
        "basket.items would give the method, not the value): rename the key"
    )
    for override, key in (
        ("+shop.keys=1", "shop.keys"),
        ("+shop={pop: 1}", "shop.pop"),
        ("+shop.lanes=[{a: 1},{get: 2}]", "shop.lanes[1].get"),
    ):
        with pytest.raises(ConfigError) as refused:
            compose_config([override])
        name = key.rpartition(".")[2]
        assert str(refused.value) == (
            f"{override}: {name!r} is the name of a method of the config object (reading "
            f"{key} would give the method, not the value): rename the key"
        )
    assert compose_config(["tracking.register=model"]).tracking.register == "model"


def test_the_command_refuses_a_key_named_like_a_method_before_anything_starts(tmp_path):
    result = run_kspipe("+experiment=omniglot_5way", "+shop.values=1", cwd=tmp_path, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kspipe: error: +shop.values=1: 'values' is the name of a method of the config "
        "object (reading shop.values would give the method, not the value): rename the key"
    ], result.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no MLflow store
