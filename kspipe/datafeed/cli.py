"""``kspipe datafeed``: write and check MultiSlot files.

kspipe datafeed generate OUT [--train-files 8 --test-files 2 --lines-per-file 5000 --seed 0]
kspipe datafeed convert RECORDS --desc DESC --output DIR [--format csv|jsonl|slot|criteo]
    [--label-slot 1] (slot: the label's slot number; criteo writes its own DESC if missing)
kspipe datafeed check --desc DESC FILE_OR_FOLDER...
"""

from __future__ import annotations

import argparse

from kspipe.errors import KspipeError, print_error


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kspipe datafeed", description="Write and check MultiSlot files."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write the click-through set with a planted signal")
    gen.add_argument("output")
    gen.add_argument("--train-files", type=int, default=8)
    gen.add_argument("--test-files", type=int, default=2)
    gen.add_argument("--lines-per-file", type=int, default=5000)
    gen.add_argument("--seed", type=int, default=0)
    conv = commands.add_parser("convert", help="CSV (with a header) or JSON lines to MultiSlot")
    conv.add_argument("records")
    conv.add_argument("--desc", required=True, help="the DataFeedDesc whose slots to write")
    conv.add_argument("--output", required=True, help="folder for part-NNNNN files")
    conv.add_argument("--format", choices=("csv", "jsonl", "slot", "criteo"), default=None)
    conv.add_argument("--label-slot", type=int, default=1, help="slot format: the label's slot")
    conv.add_argument("--label", default="label", help="slot format: the desc's label slot")
    conv.add_argument("--lines-per-file", type=int, default=100_000)
    check = commands.add_parser("check", help="parse files as Paddle's reader would")
    check.add_argument("--desc", required=True)
    check.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KspipeError as err:
        print_error(err)
        return err.exit_code


def run(args) -> int:
    from kspipe.datafeed import DataFeedDesc, convert, resolve_files, scan_files
    from kspipe.datafeed import generated as ctr_data
    from kspipe.errors import ConfigError

    if args.command == "generate":
        for name in ("train_files", "test_files", "lines_per_file"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        folder = ctr_data.generate(
            args.output, args.train_files, args.test_files, args.lines_per_file, args.seed
        )
        print(f"kspipe: wrote {folder}/{ctr_data.DESC_NAME}, {folder}/train and {folder}/test")
    elif args.command == "convert":
        if args.lines_per_file < 1:
            raise ConfigError("--lines-per-file must be at least 1")
        if args.format in ("slot", "criteo"):
            from kspipe.datafeed.convert import convert_log

            files = convert_log(
                args.records,
                args.desc,
                args.output,
                args.format,
                args.lines_per_file,
                args.label,
                args.label_slot,
            )
        else:
            files = convert(
                args.records, DataFeedDesc(args.desc), args.output, args.lines_per_file, args.format
            )
        print(f"kspipe: wrote {len(files)} MultiSlot file(s) to {args.output}")
    else:
        desc = DataFeedDesc(args.desc)
        counts = scan_files(resolve_files(args.files, "files"), desc)
        print(f"kspipe: {len(counts.lines)} file(s), {counts.total} instances: all well formed")
    return 0
