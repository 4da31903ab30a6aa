"""The click-through workload: model (:mod:`.model`), training from files
(:mod:`.training`), evaluation and export (:mod:`.evaluation`), and the plugin serving
stages program to save (:mod:`.plugin`)."""
