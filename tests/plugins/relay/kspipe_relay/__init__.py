"""A third party's process launcher, for the tests: ``cluster.launcher=relay`` starts each
planned process through ``relay.py``, which notes it in the run folder and becomes it."""
