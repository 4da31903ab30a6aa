"""Process launchers are plugins: a third party's (tests/plugins/relay:
``cluster.launcher=relay``, each process started through a relay that notes it) found
through its entry point, running a workload that is not kspipe's either
(tests/plugins/bags), on a real loopback cluster.

* the job ends with the parameters kspipe's own launcher gives, bit for bit (sync);
* the launcher's own check refuses a job in one line, before any process starts;
* an unknown launcher's error names the third party's among the choices.

(``kspipe plugins`` lists it: registry/test_entry_points.py.)
"""

import numpy as np

from kspipe.testing import assert_one_line_error, run_kspipe

SYNC = ["bags.ids=fixed", "mode=pserver", "workers=2", "servers=2", "cluster.strategy=sync"]
JOB = ["+experiment=bags", "tracking.enabled=false", *SYNC]


def kspipe(env, cwd, *args):
    return run_kspipe(*args, cwd=cwd, env=env)


def test_a_third_party_launcher_starts_the_job(bags_env, bags_run, tmp_path):
    """The launcher and the workload as installed plugins (``bags_env``,
    tests/modes/conftest.py): the relayed job ends with the parameters of the same job under
    kspipe's own launcher (``bags_run``'s sync run, which test_embedding_tables.py checks
    too), and the relay started none of that one's processes."""
    run_dir = tmp_path / "relay"
    result = kspipe(bags_env, tmp_path, *JOB, "cluster.launcher=relay", f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    relayed = (run_dir / "relayed.txt").read_text().split()
    assert sorted(relayed[::2]) == ["server.0", "server.1", "worker.0", "worker.1"]
    _, expected = bags_run("sync-fixed", *SYNC)  # cluster.launcher=processes, the default
    assert not (bags_run.folders["sync-fixed"] / "relayed.txt").exists()
    got = dict(np.load(run_dir / "params.npz"))
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_launchers_refusal_and_an_unknown_launcher_are_one_line(bags_env, tmp_path):
    result = kspipe(
        bags_env,
        tmp_path,
        *JOB,
        "workers=4",
        "cluster.launcher=relay",
        f"run_dir={tmp_path / 'big'}",
    )
    assert_one_line_error(
        result, "cluster.launcher=relay starts at most 4 processes; this job has 6"
    )
    assert not (tmp_path / "big" / "logs").exists()  # no process was started
    result = kspipe(
        bags_env, tmp_path, *JOB, "cluster.launcher=relai", f"run_dir={tmp_path / 'typo'}"
    )
    assert_one_line_error(
        result, "cluster.launcher='relai' is not one of paddle, paddlejob, processes, relay, slurm"
    )
