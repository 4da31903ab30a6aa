"""A Slurm job across emulated hosts (tests.kit.network): each node's slurmd in a host of
its own, with the host's address, linked to one bridge; the controller on the first host.
``salloc -N 3`` there runs ``kspipe ... cluster.launcher=slurm``, whose job steps Slurm
starts on the three hosts: the processes meet at the nodes' addresses and exchange over
the links, as on a cluster's machines, and reach kspipe's own launcher's weights bit for
bit.  Root only (the network and Slurm's daemons): elsewhere skipped with the reason."""

from __future__ import annotations

import pytest

from tests.kit import local_slurm, slurm_missing
from tests.kit.network import Network, unavailable
from tests.kit.slurm import allocated_job

MISSING = slurm_missing() or unavailable()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


def test_a_slurm_job_across_three_emulated_hosts_runs_a_step_on_each(tmp_path, tiny_data, launched):
    """The server and the two workers each on a host of their own (node ``i`` on host
    ``h<i>``), placed by Slurm; the run is one FINISHED run in a store all hosts see."""
    with (
        Network(hosts=3, mbit=1000) as network,
        local_slurm(tmp_path / "slurm", nodes=3, network=network) as slurm,
    ):
        first = network.hosts[0]
        run = allocated_job(
            tmp_path, tiny_data, slurm, launched, "-N", "3", "-n", "3", place=first.command
        )
    # a step on each node: the three processes ran in three hosts' networks, which reach
    # one another only over the emulated links (no loopback is shared between them)
    for node in ("node1", "node2", "node3"):
        assert "launch task StepId=" in (tmp_path / "slurm" / f"slurmd-{node}.log").read_text()
    assert sorted(p.name for p in (run / "logs").iterdir()) == [
        "server.0.log",
        "worker.0.log",
        "worker.1.log",
    ]
