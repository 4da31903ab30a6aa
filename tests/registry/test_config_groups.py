"""The config's groups of plugins and of kspipe's own parts: a plugin's group has its
schemas, defaults and checks and cannot take one of kspipe's; the cluster group is the
modes' keys then the launchers'; installed plugins share a group each with keys of its own;
a key named like a method of the config object is one line."""

from pathlib import Path

import pytest

from kspipe.errors import ConfigError
from kspipe.testing import compose_config, run_kspipe

TEST_PLUGINS = Path(__file__).resolve().parents[1] / "plugins"  # the tests' own plugins


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
    from kspipe.registry.plugin_manager import get_plugin_manager

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
    "hosts_timeout_s, peer_timeout, stall_seconds, secret_file, job_id, launcher, max_restarts, "
    "slurm_args, image"
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
        "peer_timeout": 15.0,
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
    from kspipe.registry.plugin_manager import plugin_schemas
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
    from kspipe.registry.plugin_manager import plugin_schemas
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
