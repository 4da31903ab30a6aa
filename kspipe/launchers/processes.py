"""``cluster.launcher``: who starts the processes a mode planned (a plugin may add its own).

A mode plans its job: the roles, their endpoints and Paddle's environment contract
(:func:`kspipe.cluster.plan.launch_plan`).  A process launcher places that plan and says
how each process is started; kspipe's :class:`kspipe.launchers.watcher.Cluster` then starts
them that way, watches them, stops them all when one fails and names it; each role only
plays its part.  Built in (each module a plugin of its own):

* ``processes`` (:class:`ProcessLauncher`, the default): kspipe starts this host's
  processes itself;
* ``slurm`` (:class:`kspipe.launchers.slurm.SlurmLauncher`): job steps of the Slurm allocation
  the job runs in, or, outside one, the job submitted with ``sbatch``;
* ``paddlejob`` (:class:`kspipe.launchers.kubernetes.PaddleJobLauncher`): a ``PaddleJob``
  manifest, whose pods Kubernetes starts;
* ``paddle`` (:class:`kspipe.launchers.paddle.PaddleLauncher`): Paddle's own launcher
  (``python -m paddle.distributed.launch``) starts the job's processes.

A plugin adds one by returning it from the hook ``kspipe_process_launchers``
(docs/plugins.md, "Writing a launcher").
"""

from __future__ import annotations

from kspipe import hookimpl
from kspipe.cluster.plan import Planned, launch_plan
from kspipe.errors import ConfigError
from kspipe.launchers.config import LauncherConfig
from kspipe.launchers.watcher import run_cluster


class ProcessLauncher:
    """``cluster.launcher=processes``, and the base of every process launcher: each method
    is one decision a launcher makes, in the order kspipe asks."""

    name = "processes"

    def hands_off(self, cfg) -> bool:
        """Whether the ``kspipe`` command gives the whole job to a scheduler rather than
        running it (:meth:`hand_off`).  Here: never."""
        return False

    def hand_off(self, cfg, overrides: list[str]) -> str:
        """Give the job to the scheduler (submit it, write its manifest) after every check
        of ``cfg`` passed; ``overrides`` are the command line's.  Returns the line that
        tells the user how to follow it."""
        raise NotImplementedError

    def check(self, cfg, processes: int) -> None:
        """Refuse, with a :class:`kspipe.errors.ConfigError` in one line, a job of
        ``processes`` processes that this launcher cannot start here.  Called before any
        starts and before the run is recorded."""

    def plan(self, kind: str, cfg, workers, servers=None, **options) -> list[Planned]:
        """The processes of a ``kind`` job that this launcher starts
        (:func:`kspipe.cluster.plan.launch_plan`, whose ``options`` these are): by default
        this host's."""
        return launch_plan(kind, workers, servers, cfg.cluster.host, **options)

    def run(self, cfg, reporter, plan: list[Planned], description: str, hosts=None) -> dict:
        """Start the ``plan``'s processes, watch them, stop them together when one fails or
        this process is stopped, and return the job's metrics (a
        :class:`kspipe.errors.ClusterError` naming the process that failed).  By default
        kspipe's own watcher (:func:`kspipe.launchers.watcher.run_cluster`), which starts each
        process as :meth:`command` says."""
        return run_cluster(cfg, reporter, plan, description, hosts=hosts, launcher=self)

    def command(self, planned: Planned, command: list[str]) -> list[str]:
        """The command that starts the ``planned`` process, whose own command is
        ``command``: kspipe runs it in ``planned.env`` and in the run folder, and watches
        it (its exit status is the process's, its output the role's log).  By default
        ``command`` itself."""
        return command


@hookimpl
def kspipe_config_schemas():
    """The launchers' keys of the cluster group (the modes' are theirs)."""
    return {"cluster": LauncherConfig}


@hookimpl
def kspipe_check_config(cfg):
    """The launchers' keys whose ranges no type says."""
    stall = cfg.cluster.get("stall_seconds")
    if stall is not None and stall <= 0:
        raise ConfigError(
            f"cluster.stall_seconds={stall:g} must be more than 0 (null: never stop a job "
            f"for making no progress)"
        )
    peer = cfg.cluster.get("peer_timeout")
    if peer is None or peer < 1:
        raise ConfigError(
            f"cluster.peer_timeout={peer}: must be at least 1 s (a launcher says it is alive "
            f"every quarter of it)"
        )


@hookimpl
def kspipe_process_launchers():
    return [ProcessLauncher()]
