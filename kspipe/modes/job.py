"""A mode's job, seen from the command that starts it: :class:`ClusterJob`.

The role stage returns a role where this process plays a part in the job, and a
``ClusterJob`` where it starts the job's processes: the job plans them (the mode's
business: :mod:`kspipe.cluster.plan`) and hands the plan to the process launcher
(``cluster.launcher``, :mod:`kspipe.launchers`), which starts and watches them.
"""

from __future__ import annotations


class ClusterJob:
    """What the role stage returns when this command starts the job's processes instead of
    playing a part in them (:class:`kspipe.contracts.ClusterJob`).  It is no role: it trains
    nothing, so it has no optimiser, table or server loop to offer; the pipeline calls
    :meth:`launch` and records what it returns.  It plans the job's processes and has
    the process launcher (``cluster.launcher``) start and watch them."""

    is_cluster_job = True
    mode = "local"

    def __init__(self, cfg, hosts=None, launcher=None):
        #: ``hosts``: the job's hosts when it spans several (kspipe's own control link);
        #: ``launcher``: the process launcher (:mod:`kspipe.launchers.processes`) that starts
        #: the planned processes (None: as they are, on this host)
        self.cfg, self.hosts, self.launcher = cfg, hosts, launcher
        if self.mode != "local":  # the job's secret, before anything starts
            from kspipe.cluster import secret

            secret.ensure(
                cfg.cluster.get("secret_file"), across_hosts=hosts is not None, new_job=True
            )

    def is_first_worker(self) -> bool:
        """Whether worker 0 runs on this host (this command records the run)."""
        return self.hosts is None or self.hosts.is_first

    def refuses(self, needs, cfg) -> str | None:
        """Why the job's roles cannot run a workload that ``needs`` these (their mode's
        answer, given before any process starts); None if they can."""
        return None

    def launch(self, reporter) -> dict:
        """Start the job's processes on this host, watch them, return the job's metrics."""
        raise NotImplementedError
