"""``kspipe-launch``: run an OpenKS-style training script on a local cluster.

    kspipe-launch --mode cpu --worker_num 2 --server_num 2 train.py [script args]
    kspipe-launch --mode gpu --worker_num 2 train.py

``--mode cpu`` starts parameter servers and workers (``kspipe.openks`` flag 0), ``gpu``
collective workers (flag 1; through gloo on a CPU build).  Each process runs the script
with Paddle's environment contract set; logs go to ``--log_dir``.  The first worker's
output is shown.  If any process fails, the others are stopped and the command names it
and exits non-zero (Paddle's own launcher exits 0 then).  With ``--mode cpu`` the servers
and workers share one gloo world, over which ``init_server(model_dir)`` hands the saved
model to the workers (``kspipe.openks.algorithms.HAND_OVER_ENV``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kspipe.cluster.plan import launch_plan
from kspipe.errors import KspipeError, check_integer, print_error
from kspipe.launchers.watcher import Cluster
from kspipe.openks.algorithms import HAND_OVER_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kspipe-launch", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--worker_num", type=int, default=2)
    parser.add_argument("--server_num", type=int, default=1)
    parser.add_argument("--log_dir", default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        launch(args)
    except KspipeError as err:
        print_error(err, prog="kspipe-launch")
        return err.exit_code
    return 0


def launch(args) -> None:
    from kspipe.errors import ConfigError

    if not os.path.isfile(args.script):
        raise ConfigError(f"no script {args.script}")
    log_dir = os.path.abspath(
        args.log_dir or os.path.join("kspipe-launch-logs", time.strftime("%Y-%m-%d_%H-%M-%S"))
    )
    os.makedirs(log_dir, exist_ok=True)
    command = [sys.executable, "-u", os.path.abspath(args.script), *args.script_args]
    kind = "pserver" if args.mode == "cpu" else "collective"
    plan = launch_plan(
        kind,
        check_integer(args.worker_num, "--worker_num"),
        check_integer(args.server_num, "--server_num") if kind == "pserver" else None,
    )
    cluster = Cluster(log_dir, log_dir=log_dir)
    cluster.echo_first_worker = "all"
    try:
        for p in plan:
            env = dict(p.env, **HAND_OVER_ENV) if kind == "pserver" else p.env
            cluster.start(p.role, p.index, env, command, cwd=os.getcwd())
        cluster.wait(args.timeout)
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
