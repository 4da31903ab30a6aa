"""kspipe-classifier: a supervised classifier workload for kspipe, in every mode."""
