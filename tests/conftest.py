import os

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")  # Paddle's C++ log, read when Paddle loads
os.environ.setdefault("KSPIPE_DISABLE_PLUGIN_AUTOLOAD", "1")

#: The suite runs on two processes (pytest-xdist, ``--dist loadgroup``), a test file whole
#: on one of them, so its module fixtures are made once.  The files that share a session
#: fixture of tests/modes/conftest.py or the one local Slurm (two on one host break each
#: other) run on the same process, in one group.
SHARED = {
    "modes": {
        "test_slurm.py",
        "test_slurm_hosts.py",
        "test_slurm_submitted.py",
        "test_launchers.py",
        "test_preemption.py",
        "test_scheduled_roles.py",
        "test_scheduled_manifests.py",
        "test_embedding_tables.py",
    }
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        group = next(
            (name for name, files in SHARED.items() if item.path.name in files),
            item.nodeid.split("::")[0],
        )
        item.add_marker(pytest.mark.xdist_group(group))


def in_ci() -> bool:
    """Whether the suite runs as CI (``CI=true``, as .ci/run and most CI services set it)."""
    return os.environ.get("CI", "").lower() in ("true", "1")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``CI=true``, a test skipped for want of a set-up this machine must have (Slurm,
    Chromium, a mountable disk, as root on Debian: tests.kit.setups) fails, naming it;
    other skips (another platform's test) stay skips."""
    report = yield
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return report
    from tests.kit import missing_here

    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    for name, why in missing_here().items():
        if reason.removeprefix("Skipped: ") == why:
            report.outcome = "failed"
            report.longrepr = (
                f"CI=true: skipped for want of {name}, which this machine "
                f"(root, Debian with apt) must have: {why}"
            )
    return report


@pytest.fixture(autouse=True)
def refusals_logged_afresh(monkeypatch):
    """Each test counts the refused connections its process logs from none, as a job's
    process does (kspipe.cluster.secret logs the first 20): the suite's worker process runs
    many tests, and a test's count must not depend on which ran before it."""
    from kspipe.cluster import secret

    monkeypatch.setattr(secret, "_refusals", 0)


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
        return compose_config(
            ["+experiment=omniglot_5way", *tiny_overrides(tmp_path, tiny_data), *overrides]
        )

    return make


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm on loopback (tests.kit.local_slurm): the environment its commands
    need.  Its tests are marked to run only where one can start (``slurm_missing``)."""
    from tests.kit import local_slurm

    with local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield env
