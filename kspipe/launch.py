"""``kspipe-launch``: run an OpenKS-style training script on a local cluster.

    kspipe-launch --mode cpu --worker_num 2 --server_num 2 train.py [script args]
    kspipe-launch --mode gpu --worker_num 2 train.py

``--mode cpu`` starts parameter servers and workers (``kspipe.openks`` flag 0), ``gpu``
collective workers (flag 1; through gloo on a CPU build).  Each process runs the script
with Paddle's environment contract set; logs go to ``--log_dir``.  The first worker's
output is shown.  If any process fails, the others are stopped and the command names it
and exits non-zero (Paddle's own launcher exits 0 then).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kspipe.cluster import Cluster, free_ports, gloo_env
from kspipe.errors import KspipeError


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
        print(f"kspipe-launch: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


def launch(args) -> None:
    from kspipe.builtin.pserver import paddle_env
    from kspipe.errors import ConfigError

    if args.worker_num < 1 or (args.mode == "cpu" and args.server_num < 1):
        raise ConfigError("--worker_num and --server_num must be at least 1")
    if not os.path.isfile(args.script):
        raise ConfigError(f"no script {args.script}")
    log_dir = os.path.abspath(args.log_dir or os.path.join(
        "kspipe-launch-logs", time.strftime("%Y-%m-%d_%H-%M-%S")))
    os.makedirs(log_dir, exist_ok=True)
    command = [sys.executable, "-u", os.path.abspath(args.script), *args.script_args]
    workers = [f"127.0.0.1:{p}" for p in free_ports(args.worker_num)]
    threads = str(max(1, (os.cpu_count() or 1) // args.worker_num))
    cluster = Cluster(log_dir, log_dir=log_dir)
    cluster.echo_first_worker = "all"
    try:
        if args.mode == "cpu":
            servers = [f"127.0.0.1:{p}" for p in free_ports(args.server_num)]
            base = dict(os.environ, **paddle_env(servers, workers, "127.0.0.1"),
                        **gloo_env(log_dir, servers + workers, ""))
            for i, endpoint in enumerate(servers):
                cluster.start("server", i, dict(base, TRAINING_ROLE="PSERVER", OMP_NUM_THREADS="1",
                                                PADDLE_PORT=endpoint.rpartition(":")[2],
                                                PADDLE_TRAINER_ID="0"), command)
            for i, endpoint in enumerate(workers):
                cluster.start("worker", i, dict(base, TRAINING_ROLE="TRAINER", OMP_NUM_THREADS=threads,
                                                PADDLE_PORT=endpoint.rpartition(":")[2],
                                                PADDLE_TRAINER_ID=str(i)), command)
        else:
            base = dict(os.environ, PADDLE_TRAINER_ENDPOINTS=",".join(workers),
                        PADDLE_TRAINERS_NUM=str(len(workers)), GLOG_minloglevel="2",
                        **gloo_env(log_dir, workers, ""))
            for i, endpoint in enumerate(workers):
                cluster.start("worker", i, dict(base, PADDLE_TRAINER_ID=str(i),
                                                PADDLE_CURRENT_ENDPOINT=endpoint,
                                                OMP_NUM_THREADS=threads), command)
        cluster.wait(args.timeout)
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
