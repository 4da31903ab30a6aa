# Lets pytest import kspipe_shapes from this folder when the package is not installed.
