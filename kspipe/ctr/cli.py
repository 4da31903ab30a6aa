"""``kspipe ctr``: the click-through workload's own commands.

kspipe ctr refresh MODEL CHECKPOINT --output DIR [--full]
    the stream model MODEL (an exported folder) brought up to the stream's delta
    CHECKPOINT without a full export (:mod:`kspipe.ctr.stream.refresh`); ``--full``: the
    model of CHECKPOINT's base and the deltas after it (a base needs it)
"""

from __future__ import annotations

import argparse

from kspipe.errors import KspipeError, print_error


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kspipe ctr", description="Click-through models.")
    commands = parser.add_subparsers(dest="command", required=True)
    refresh = commands.add_parser(
        "refresh", help="bring a stream's exported model up to a later delta save"
    )
    refresh.add_argument("model", help="the exported model's folder (<run>/inference_model)")
    refresh.add_argument("checkpoint", help="a save of the stream (<run>/checkpoints/...)")
    refresh.add_argument("--output", required=True, help="folder for the refreshed model")
    refresh.add_argument(
        "--full", action="store_true", help="the rows of CHECKPOINT's base and later deltas"
    )
    args = parser.parse_args(argv)
    try:
        from kspipe.ctr.stream.refresh import refresh as run
        from kspipe.files import user_path

        paths = [user_path(p) for p in (args.model, args.checkpoint, args.output)]
        print(f"kspipe: {run(*paths, args.full)}")
        return 0
    except KspipeError as err:
        print_error(err)
        return err.exit_code
