"""The plugins that ship with kspipe; :func:`kspipe.plugin_manager.builtin_plugins` lists them."""
