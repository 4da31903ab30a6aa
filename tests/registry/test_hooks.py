"""The stage registry: every hook documented and exercised, stages chosen by name,
typos rejected.  (Installed plugins, loaded through the entry-point group:
test_entry_points.py.)"""

import inspect

import pluggy
import pytest

from kspipe import hookimpl
from kspipe.errors import ConfigError
from kspipe.pipeline import check_mode, run, stage_caller
from kspipe.registry import hookspecs
from kspipe.registry.plugin_manager import STAGES, get_plugin_manager
from kspipe.testing import HookRecorder, plugin_manager

HOOKS = [
    name
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
    if name.startswith("kspipe_")
]


def test_every_hook_is_prefixed_and_documented():
    assert len(HOOKS) == 20
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert doc and len(doc) > 40, name
        for param in inspect.signature(getattr(hookspecs, name)).parameters:
            assert f":param {param}:" in doc, (name, param)


BUILTIN_SERVING = {
    "role": "local",
    "dataset": "open_ks",
    "program": "reptile",
    "compile": "reptile",
    "execute": "reptile",
    "save": "reptile",
}


def test_every_stage_has_a_firstresult_hook_and_a_builtin_implementation():
    pm = get_plugin_manager(load_entrypoints=False)
    assert set(STAGES) == set(BUILTIN_SERVING) and set(STAGES.values()) <= set(HOOKS)
    for stage, hook in STAGES.items():
        assert getattr(pm.hook, hook).spec.opts["firstresult"], hook
        caller = stage_caller(pm, stage, BUILTIN_SERVING[stage])
        assert [impl.plugin_name for impl in caller.get_hookimpls()] == [BUILTIN_SERVING[stage]]


class StageSpy:
    """Serves every stage by delegating to the built-ins, and records the order."""

    def __init__(self):
        self.order = []
        self.builtin = dict(get_plugin_manager(load_entrypoints=False).list_name_plugin())

    @hookimpl
    def kspipe_assign_role(self, cfg, launcher):
        self.order.append("kspipe_assign_role")
        return self.builtin["local"].kspipe_assign_role(cfg=cfg, launcher=launcher)

    @hookimpl
    def kspipe_read_dataset(self, cfg, role):
        self.order.append("kspipe_read_dataset")
        return self.builtin["open_ks"].kspipe_read_dataset(cfg=cfg, role=role)

    @hookimpl
    def kspipe_build_program(self, cfg, dataset, role):
        self.order.append("kspipe_build_program")
        return self.builtin["reptile"].kspipe_build_program(cfg=cfg, dataset=dataset, role=role)

    @hookimpl
    def kspipe_compile_program(self, cfg, role, programs):
        self.order.append("kspipe_compile_program")
        return programs

    @hookimpl
    def kspipe_execute(self, cfg, role, dataset, programs, executor, scope, reporter):
        self.order.append("kspipe_execute")
        return self.builtin["reptile"].kspipe_execute(
            cfg=cfg,
            role=role,
            dataset=dataset,
            programs=programs,
            executor=executor,
            scope=scope,
            reporter=reporter,
        )

    @hookimpl
    def kspipe_save_inference_model(self, cfg, role, programs, executor, scope, dirname):
        self.order.append("kspipe_save_inference_model")
        return self.builtin["reptile"].kspipe_save_inference_model(
            cfg=cfg, role=role, programs=programs, executor=executor, scope=scope, dirname=dirname
        )

    @hookimpl
    def kspipe_config_dirs(self):
        return []


def test_config_chooses_the_plugin_of_each_stage_and_every_hook_fires(tiny_cfg):
    spy, recorder = StageSpy(), HookRecorder()
    overrides = [f"stages.{stage}=spy" for stage in STAGES]
    cfg = tiny_cfg(*overrides, "stages.role=spy", "mode=local")
    pm = plugin_manager(("spy", spy), ("recorder", recorder))
    run(cfg, pm)
    assert spy.order == list(STAGES.values())
    fired = set(spy.order) | set(recorder.names())
    assert fired | {
        "kspipe_run_error",
        "kspipe_on_stage_error",
        "kspipe_config_dirs",
        "kspipe_describe_workload",
        "kspipe_process_launchers",
        "kspipe_config_schemas",
    } == set(HOOKS)
    assert pm.hook.kspipe_config_dirs() == [[]]


def test_run_error_hook_hears_a_failing_stage(tiny_cfg):
    class Broken:
        @hookimpl
        def kspipe_build_program(self, cfg, dataset):
            raise ConfigError("model.layers makes no sense")

    recorder = HookRecorder()
    with pytest.raises(ConfigError):
        run(
            tiny_cfg(
                "stages.program=broken",
                "stages.compile=reptile",
                "stages.execute=reptile",
                "stages.save=reptile",
            ),
            plugin_manager(("broken", Broken()), recorder),
        )
    assert recorder.names()[-1] == "kspipe_run_error"
    assert isinstance(recorder.calls[-1][1]["error"], ConfigError)


def test_a_misspelt_hook_is_rejected():
    class Typo:
        @hookimpl
        def kspipe_read_datset(self, cfg):
            return None

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Typo())
    with pytest.raises(pluggy.PluginValidationError, match="kspipe_read_datset"):
        pm.check_pending()


def test_unknown_plugin_for_a_stage_lists_the_available_ones():
    pm = get_plugin_manager(load_entrypoints=False)
    with pytest.raises(
        ConfigError, match=r"stages.dataset='imagenet22k'.*available: datafeed, open_ks"
    ):
        stage_caller(pm, "dataset", "imagenet22k")
    with pytest.raises(
        ConfigError, match=r"unknown mode 'ring' \(available: collective, local, pserver\)"
    ):
        check_mode(pm, "ring")
