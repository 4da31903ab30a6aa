"""Checkpointing the parameter servers' tables: a sparse table of a million ids.

    python bench/bench_tables.py [--ids 1000000] [--servers 2]

Writes MultiSlot files in which every id of ``--ids`` appears once (a label, one id, one
float), trains ``+experiment=ctr_datafeed`` on them for one epoch with ``mode=pserver
workers=2 servers=<servers>`` (so the servers hold a row for every id), then resumes that
run with nothing left to train (the tables loaded back).  Prints the checkpoint's size,
how long writing it and loading it took (from the runs' own lines), and whether the
restored model scores exactly as the saved one.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DESC = """name: "MultiSlotDataFeed"
batch_size: 512
multi_slot_desc {
  slots { name: "label" type: "uint64" is_used: true }
  slots { name: "ids" type: "uint64" is_used: true }
  slots { name: "price" type: "float" is_dense: true is_used: true }
}
"""


def write_files(folder: Path, ids: int, files: int = 4) -> None:
    (folder / "train").mkdir(parents=True)
    (folder / "test").mkdir()
    (folder / "desc.prototxt").write_text(DESC)
    rng = np.random.default_rng(0)
    order = rng.permutation(ids) + 1  # id 0 is padding to Paddle's sparse tables
    for f, part in enumerate(np.array_split(order, files)):
        label = rng.integers(0, 2, len(part))
        price = rng.normal(size=len(part))
        lines = [f"1 {y} 1 {i} 1 {p:.3f}" for y, i, p in zip(label, part, price)]
        (folder / "train" / f"part-{f}").write_text("\n".join(lines) + "\n")
    held_out = (folder / "train" / "part-0").read_text().splitlines(keepends=True)[:10000]
    (folder / "test" / "part-0").write_text("".join(held_out))


def kspipe(folder: Path, *overrides) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "+experiment=ctr_datafeed",
            "mode=pserver",
            "workers=2",
            f"datafeed.desc={folder / 'desc.prototxt'}",
            f"datafeed.train_files={folder / 'train'}",
            f"datafeed.test_files={folder / 'test'}",
            "ctr.epochs=1",
            "tracking.enabled=false",
            "cluster.timeout_s=1800",
            *overrides,
        ],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return result


def seconds(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_files(folder, args.ids)
        hash_size = f"ctr.hash_size={args.ids + 1}"
        trained = kspipe(folder, f"servers={args.servers}", hash_size, f"run_dir={folder / 'one'}")
        (saved,) = (folder / "one" / "checkpoints").iterdir()
        manifest = json.loads((saved / "tables" / "manifest.json").read_text())
        size = sum(manifest["files"].values())
        resumed = kspipe(
            folder,
            f"servers={args.servers}",
            hash_size,
            f"run_dir={folder / 'again'}",
            f"resume={folder / 'one'}",
        )
        before = json.loads((folder / "one" / "metrics.json").read_text())
        after = json.loads((folder / "again" / "metrics.json").read_text())
        print(
            f"{args.ids:,} ids on {args.servers} servers: tables {size / 2**20:.1f} MiB in "
            f"{len(manifest['files'])} files"
        )
        written = seconds(r"checkpoint \S+: training waited ([0-9.]+) s", trained.stderr)
        loaded = seconds(r"tables loaded in ([0-9.]+) s", resumed.stderr)
        print(
            f"  training waited {written:.2f} s for the checkpoint, tables loaded in {loaded:.2f} s"
        )
        print(
            f"  test AUC saved {before['test_auc']:.6f}, restored {after['test_auc']:.6f}"
            f" (apart by {abs(before['test_auc'] - after['test_auc']):.1e}: the servers "
            f"write tables as text, 6 significant digits)"
        )


if __name__ == "__main__":
    main()
