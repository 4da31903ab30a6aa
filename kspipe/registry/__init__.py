"""The hook registry: every stage's hook specification (:mod:`.hookspecs`) and the plugin
manager that holds the built-in and installed plugins (:mod:`.plugin_manager`).  What the
hooks pass around is :mod:`kspipe.contracts`."""
