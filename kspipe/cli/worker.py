"""One role of a cluster job: ``python -m kspipe.cli.worker <run_dir>/job.yaml``.

The launcher starts this with Paddle's environment contract set (``TRAINING_ROLE`` and
friends); the role stage reads it and plays that role.
"""

from __future__ import annotations

import os
import sys

from kspipe.memory import cap_arenas, executor_defaults
from kspipe.cluster.environment import share_cores

os.environ.setdefault("GLOG_minloglevel", "2")
cap_arenas()  # before any thread starts
executor_defaults()  # before Paddle loads
share_cores(os.environ)  # before Paddle loads OpenMP, whoever started this role


def main(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from kspipe import stopping
    from kspipe.errors import KspipeError, print_error
    from kspipe.pipeline import run

    if len(argv) != 1:
        print("usage: python -m kspipe.cli.worker <job.yaml>", file=sys.stderr)
        return 2
    stopping.end_quickly()
    try:
        stopping.install()
        cfg = OmegaConf.load(argv[0])
        run(cfg)
    except KspipeError as err:
        print_error(err)
        return err.exit_code
    except stopping.Preempted as stop:
        print_error(f"stopped by {stop.name}")
        return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
