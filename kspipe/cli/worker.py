"""One role of a cluster job: ``python -m kspipe.cli.worker <run_dir>/job.yaml``.

The launcher starts this with Paddle's environment contract set (``TRAINING_ROLE`` and
friends); the role stage reads it and plays that role.
"""

from __future__ import annotations

import os
import sys

from kspipe.cli.process import prepare_process


def main(argv: list[str]) -> int:
    """Run the job ``argv[0]`` (a resolved config) as the role the environment gives this
    process; its exit code."""
    prepare_process(role=True)  # first: before any thread starts and Paddle loads
    from omegaconf import OmegaConf

    from kspipe.errors import KspipeError, NonFiniteError, print_error
    from kspipe.launchers.restarts import NON_FINITE_EXIT
    from kspipe.pipeline import run
    from kspipe.process import heartbeat, stopping

    if len(argv) != 1:
        print("usage: python -m kspipe.cli.worker <job.yaml>", file=sys.stderr)
        return 2
    if os.environ.get(stopping.DIE_WITH_PARENT) == "1" and not stopping.die_with_parent():
        print_error("the launcher that started this role is gone")
        return 1
    stopping.end_quickly()
    heartbeat.start()  # where it is, for the launcher (kspipe/launchers/stalls.py)
    try:
        stopping.install()
        cfg = OmegaConf.load(argv[0])
        run(cfg)
    except KspipeError as err:
        print_error(err)
        return NON_FINITE_EXIT if isinstance(err, NonFiniteError) else err.exit_code
    except stopping.Preempted as stop:
        print_error(f"stopped by {stop.name}")
        return stop.exit_code
    finally:
        heartbeat.end()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
