"""Mode ``local``: one process is the only worker (stage ``role``).

With ``isolate`` (the default in a sweep) the command starts that process as a child of
its own and watches it, so nothing a job leaves in its Paddle process (the dataset
trainer's thread pool, global flags, math threads) reaches the sweep's next job.
"""

from __future__ import annotations

import os

from kspipe import hookimpl
from kspipe.errors import ClusterError, KspipeError
from kspipe.endpoints import process_count
from kspipe.modes.launch import Launcher, error_line, run_cluster
from kspipe.modes.plan import launch_plan
from kspipe.modes.role import Role
from kspipe.reporting import say


@hookimpl
def kspipe_assign_role(cfg):
    if process_count(cfg.workers, "workers") != 1:
        say(f"workers={cfg.workers} is ignored: mode=local runs one process (mode=pserver "
            f"or mode=collective runs several)")
    if cfg.get("isolate"):
        return IsolatedLauncher(cfg)
    return Role()


class IsolatedLauncher(Launcher):
    """Runs the local job in one child process (``python -m kspipe.worker``)."""

    def launch(self, reporter) -> dict:
        from omegaconf import OmegaConf, open_dict

        child = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True))
        with open_dict(child):
            child.isolate = False
            child.workers = 1  # the launcher said it ignores the count
        try:
            return run_cluster(child, reporter, launch_plan("local", 1),
                               "the job in a process of its own")
        except ClusterError as err:
            message = error_line(os.path.join(reporter.run_dir, "logs", "worker.0.log"))
            if message:  # the job's own one-line error, as a run in this process gives it
                raise KspipeError(message) from err
            raise
