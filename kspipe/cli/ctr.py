"""``kspipe ctr``: the click-through workload's own commands.

kspipe ctr refresh MODEL CHECKPOINT --output DIR [--full] [--tracking-uri URI]
    [--log RUN_ID [--register NAME [--alias ALIAS]]]
    the stream model MODEL (an exported folder, or an MLflow model: models:/<id>,
    runs:/<run id>/model) brought up to the stream's delta CHECKPOINT without a full
    export (:mod:`kspipe.ctr.stream.refresh`); ``--full``: the model of CHECKPOINT's base
    and the deltas after it (what a base needs); ``--log``: the refreshed model logged as
    a new MLflow model of that run, at the save's pass as its step
"""

from __future__ import annotations

import argparse
import tempfile

from kspipe.errors import ConfigError, KspipeError, print_error

SERVING = "kspipe.ctr.serving:ClickModel"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kspipe ctr", description="Click-through models.")
    commands = parser.add_subparsers(dest="command", required=True)
    refresh = commands.add_parser(
        "refresh", help="bring a stream's exported model up to a later delta save"
    )
    refresh.add_argument("model", help="<run>/inference_model, or an MLflow model's URI")
    refresh.add_argument("checkpoint", help="a save of the stream (<run>/checkpoints/...)")
    refresh.add_argument("--output", required=True, help="folder for the refreshed model")
    refresh.add_argument(
        "--full", action="store_true", help="the rows of CHECKPOINT's base and later deltas"
    )
    refresh.add_argument("--tracking-uri", help="the MLflow store of an MLflow MODEL or --log")
    refresh.add_argument("--log", metavar="RUN_ID", help="log the model to this MLflow run")
    refresh.add_argument("--register", help="and register it under this name")
    refresh.add_argument("--alias", help="and point this alias of the name at it")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KspipeError as err:
        print_error(err)
        return err.exit_code


def run(args) -> int:
    from kspipe.ctr.stream.refresh import refresh
    from kspipe.files import user_path

    mlflow_model = args.model.startswith(("models:/", "runs:/"))
    if (mlflow_model or args.log) and not args.tracking_uri:
        raise ConfigError("an MLflow model or --log needs --tracking-uri (the MLflow store)")
    if (args.register or args.alias) and not args.log:
        raise ConfigError("--register and --alias name the model --log logs: give --log")
    checkpoint, output = user_path(args.checkpoint), user_path(args.output)
    with tempfile.TemporaryDirectory() as downloaded:
        model = user_path(args.model)
        if mlflow_model:
            from kspipe.observers.mlflow.serving import download_model

            model = download_model(args.model, args.tracking_uri, downloaded)
        print(f"kspipe: {refresh(model, checkpoint, output, args.full)}", flush=True)
    if args.log:
        from kspipe.ctr.stream.refresh import served_save
        from kspipe.observers.mlflow.serving import log_model_folder

        step = served_save(output)["pass"]
        log_model_folder(
            args.tracking_uri,
            args.log,
            output,
            SERVING,
            step,
            register=args.register,
            alias=args.alias,
        )
        print(f"kspipe: logged {output} as a model of run {args.log} at step {step}")
    return 0
