import os

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("KSPIPE_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """30 KanjiVG characters drawn by 6 drawers, Omniglot layout."""
    from kspipe.testing import tiny_omniglot

    return tiny_omniglot(tmp_path_factory.mktemp("kanji"))


@pytest.fixture
def tiny_cfg(tmp_path, tiny_data):
    """A config for a run of a few seconds that writes only under tmp_path."""
    from kspipe.testing import compose_config, tiny_overrides

    def make(*overrides):
        return compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data),
                               *overrides])

    return make


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm on loopback (kspipe.testing.local_slurm): the environment its
    commands need.  Its tests are marked to run only where one can start
    (``slurm_missing``)."""
    from kspipe.testing import local_slurm

    with local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield env
