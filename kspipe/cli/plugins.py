"""``kspipe plugins``: the installed plugins, where they come from, and the hooks they serve."""

from __future__ import annotations

from kspipe.registry.plugin_manager import STAGES, get_plugin_manager, installed_packages


def list_plugins(args: list[str]) -> int:
    pm = get_plugin_manager()
    packages = installed_packages()
    stage_of = {hook: stage for stage, hook in STAGES.items()}
    print(f"{'plugin':<14} {'package':<24} hooks")
    for name, plugin in sorted(pm.list_name_plugin()):
        package = packages.get(name, "kspipe (built-in)")
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        shown = [f"{h} [stage {stage_of[h]}]" if h in stage_of else h for h in hooks]
        if "kspipe_process_launchers" in hooks:  # the cluster.launcher values it adds
            names = ", ".join(
                f"cluster.launcher={launcher.name}"
                for launcher in plugin.kspipe_process_launchers() or ()
            )
            shown[hooks.index("kspipe_process_launchers")] += f" [{names}]"
        print(f"{name:<14} {package:<24} {', '.join(shown)}")
    return 0
