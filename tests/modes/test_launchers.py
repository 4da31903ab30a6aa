"""Process launchers are plugins: a third party's (tests/plugins/relay:
``cluster.launcher=relay``, each process started through a relay that notes it) found
through its entry point, running a workload that is not kspipe's either
(tests/plugins/bags), on a real loopback cluster.

* the job ends with the parameters kspipe's own launcher gives, bit for bit (sync);
* the launcher's own check refuses a job in one line, before any process starts;
* an unknown launcher's error names the third party's among the choices.

(``kspipe plugins`` lists it: registry/test_entry_points.py.)
"""

from pathlib import Path

import numpy as np
import pytest

from kspipe.testing import assert_one_line_error, install_plugin, plugin_env, run_kspipe

TEST_PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
JOB = ["+experiment=bags", "tracking.enabled=false", "bags.ids=fixed", "mode=pserver",
       "workers=2", "servers=2", "cluster.strategy=sync"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The launcher and the workload as installed plugins."""
    site = tmp_path_factory.mktemp("site")
    install_plugin(site, TEST_PLUGINS / "relay" / "kspipe_relay", "relay = kspipe_relay.plugin")
    install_plugin(site, TEST_PLUGINS / "bags" / "kspipe_bags", "bags = kspipe_bags.plugin")
    return plugin_env(site)


def kspipe(env, cwd, *args):
    return run_kspipe(*args, cwd=cwd, env=env)


def test_a_third_party_launcher_starts_the_job(installed, tmp_path):
    runs = {}
    for launcher in ("processes", "relay"):
        run_dir = tmp_path / launcher
        result = kspipe(installed, tmp_path, *JOB, f"cluster.launcher={launcher}",
                        f"run_dir={run_dir}")
        assert result.returncode == 0, (launcher, result.stderr[-3000:])
        runs[launcher] = dict(np.load(run_dir / "params.npz"))
    relayed = (tmp_path / "relay" / "relayed.txt").read_text().split()
    assert sorted(relayed[::2]) == ["server.0", "server.1", "worker.0", "worker.1"]
    assert not (tmp_path / "processes" / "relayed.txt").exists()
    for name, value in runs["processes"].items():
        np.testing.assert_array_equal(runs["relay"][name], value, err_msg=name)


def test_a_launchers_refusal_and_an_unknown_launcher_are_one_line(installed, tmp_path):
    result = kspipe(installed, tmp_path, *JOB, "workers=4", "cluster.launcher=relay",
                    f"run_dir={tmp_path / 'big'}")
    assert_one_line_error(result, "cluster.launcher=relay starts at most 4 processes; this "
                                  "job has 6")
    assert not (tmp_path / "big" / "logs").exists()  # no process was started
    result = kspipe(installed, tmp_path, *JOB, "cluster.launcher=relai",
                    f"run_dir={tmp_path / 'typo'}")
    assert_one_line_error(result, "cluster.launcher='relai' is not one of paddle, "
                                  "paddlejob, processes, relay, slurm")
