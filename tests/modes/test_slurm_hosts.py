"""A Slurm job across emulated hosts (tests.kit.network): each node's slurmd in a host of
its own, with the host's address, linked to one bridge; the controller on the first host.
``salloc -N 3`` there runs ``kspipe ... cluster.launcher=slurm``, whose job steps Slurm
starts on the three hosts: the processes meet at the nodes' addresses and exchange over
the links, as on a cluster's machines, and reach kspipe's own launcher's weights bit for
bit.  Root only (the network and Slurm's daemons): elsewhere skipped with the reason."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from kspipe.testing import run_statuses
from tests.kit import latest_weights, local_slurm, scheduled_overrides, slurm_missing
from tests.kit.network import Network, unavailable

MISSING = slurm_missing() or unavailable()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


def test_a_slurm_job_across_three_emulated_hosts_runs_a_step_on_each(tmp_path, tiny_data, launched):
    """The server and the two workers each on a host of their own (node ``i`` on host
    ``h<i>``), placed by Slurm; the run is one FINISHED run in a store all hosts see."""
    run = tmp_path / "run"
    with (
        Network(hosts=3, mbit=1000) as network,
        local_slurm(tmp_path / "slurm", nodes=3, network=network) as slurm,
    ):
        first = network.hosts[0]
        result = first.run(
            [
                "salloc",
                "-N",
                "3",
                "-n",
                "3",
                "--quiet",
                sys.executable,
                "-m",
                "kspipe.cli.command",
                *scheduled_overrides(tmp_path, tiny_data),
                "cluster.launcher=slurm",
                f"run_dir={run}",
            ],
            cwd=tmp_path,
            env=dict(os.environ, **slurm),
            capture_output=True,
            text=True,
            timeout=600,
        )
        steps = {
            node: "launch task StepId=" in (tmp_path / "slurm" / f"slurmd-{node}.log").read_text()
            for node in ("node1", "node2", "node3")
        }
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps == {"node1": True, "node2": True, "node3": True}
    addresses = {h.address for h in network.hosts}
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert all(f"{address}:" in logs for address in addresses), logs[-3000:]
    got = latest_weights(run)
    assert set(got) == set(launched)
    for name, value in launched.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
