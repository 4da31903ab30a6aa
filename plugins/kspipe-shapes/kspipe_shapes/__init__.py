"""kspipe-shapes: an example kspipe plugin package (see ``plugin.py``)."""
