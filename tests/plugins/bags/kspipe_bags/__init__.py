"""A workload written for kspipe's tests: bag-of-ids regression through ``role.embedding``."""
