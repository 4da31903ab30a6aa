"""Mode ``local``: one process is the only worker (stage ``role``); its role is the core's
one-process role, :class:`kspipe.role.Role`.

With ``isolate`` (the default in a sweep) the command starts that process as a child of
its own and watches it, so nothing a job leaves in its Paddle process (the dataset
trainer's thread pool, global flags, math threads) reaches the sweep's next job.
"""

from __future__ import annotations

import os

from kspipe import hookimpl
from kspipe.cluster.endpoints import process_count
from kspipe.errors import ClusterError, KspipeError
from kspipe.launchers.watcher import error_line
from kspipe.modes.job import ClusterJob
from kspipe.reporting import say
from kspipe.role import Role


@hookimpl
def kspipe_assign_role(cfg, launcher):
    if process_count(cfg.workers, "workers") != 1:
        say(
            f"workers={cfg.workers} is ignored: mode=local runs one process (mode=pserver "
            f"or mode=collective runs several)"
        )
    if cfg.get("isolate"):
        return IsolatedJob(cfg, launcher=launcher)
    return Role()


class IsolatedJob(ClusterJob):
    """Runs the local job in one child process (``python -m kspipe.cli.worker``), started
    and watched by the process launcher ``cluster.launcher`` names, as a cluster's are."""

    def launch(self, reporter) -> dict:
        from omegaconf import OmegaConf, open_dict

        child = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True))
        with open_dict(child):
            child.isolate = False
            child.workers = 1  # the role stage said it ignores the count
        self.launcher.check(child, 1)
        try:
            return self.launcher.run(
                child,
                reporter,
                self.launcher.plan("local", child, 1),
                "the job in a process of its own",
            )
        except ClusterError as err:
            message = error_line(os.path.join(reporter.run_dir, "logs", "worker.0.log"))
            if message:  # the job's own one-line error, as a run in this process gives it
                raise KspipeError(message) from err
            raise
