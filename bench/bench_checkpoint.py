"""How long a checkpoint stops training: copying the state against writing its files.

    python bench/bench_checkpoint.py [--filters 32 64 128 256] [--repeats 5] [--ids 200000]

* Reptile in one process, for a few model sizes (``model.filters``, 5-way Omniglot
  images): each checkpoint written as it was before the state was written aside (copy,
  files, rename, on the training thread), then with :class:`kspipe.checkpoint.Writer`
  (training waits for the copy; the files are written on the writer's thread): the
  medians of ``--repeats`` checkpoints.
* A parameter-server job with the servers' tables (``+experiment=ctr_datafeed``,
  ``mode=pserver workers=2 servers=2``, 2 epochs over ``--ids`` ids, every id a row on
  the servers): what training waited for at each epoch's checkpoint and the part of it
  the servers spent writing their tables, from the job's own lines.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kit


def reptile_learner(folder: str, filters: int):
    import paddle

    from kspipe.reptile.programs import build_programs
    from kspipe.testing import compose_config
    from tests.kit.adaptation import cpu_learner

    paddle.enable_static()
    cfg = compose_config(
        [f"model.filters={filters}", "train.keep_checkpoints=1", f"run_dir={folder}/run"]
    )
    programs = build_programs((28, 28, 1), cfg.task.ways, cfg.model, 0.001, seed=0)
    return cpu_learner(cfg, None, programs)


def one_process(filters: int, repeats: int) -> dict:
    """Median milliseconds of a checkpoint written on the training thread, and of one
    written aside: the training thread's wait (the copy) and the writer's time."""
    from kspipe import checkpoint

    with tempfile.TemporaryDirectory() as folder:
        learner = reptile_learner(folder, filters)
        state = checkpoint.copy_state(learner.p.train, learner.scope)
        size = sum(a.nbytes for part in (".pdparams", ".pdopt") for a in state[part].values())
        inline, waited, aside = [], [], []
        writer = checkpoint.Writer()
        for step in range(repeats):
            args = (learner.p.train, learner.scope, f"{folder}/ck", step)
            extra = ({"meta_iteration": step}, 1, learner.cfg)
            began = time.perf_counter()
            checkpoint.save(*args, *extra)
            inline.append(time.perf_counter() - began)
            began = time.perf_counter()
            checkpoint.save(*args, *extra, writer=writer)
            waited.append(time.perf_counter() - began)
            writer.wait()
            aside.append(time.perf_counter() - began - waited[-1])
    ms = lambda values: 1000 * statistics.median(values)  # noqa: E731
    return {"MB": size / 1e6, "inline": ms(inline), "waited": ms(waited), "aside": ms(aside)}


def pserver_job(ids: int) -> list[tuple[float, float]]:
    """(seconds training waited, of which the servers' tables) at each epoch's checkpoint."""
    from bench_tables import kspipe, write_files

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_files(folder, ids)
        result = kspipe(
            folder,
            "servers=2",
            f"ctr.hash_size={ids + 1}",
            "ctr.epochs=2",
            f"run_dir={folder / 'one'}",
        )
        found = re.findall(
            r"training waited ([0-9.]+) s \(the servers' tables ([0-9.]+) s\)", result.stderr
        )
        return [(float(w), float(t)) for w, t in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--filters", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ids", type=int, default=200_000, help="0: no parameter-server job")
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print("reptile, one process (median ms of a checkpoint):")
    print("  filters  state MB  written inline  waited (copy)  written aside")
    for filters in args.filters:
        r = one_process(filters, args.repeats)
        print(
            f"  {filters:7d}  {r['MB']:8.2f}  {r['inline']:14.1f}  {r['waited']:13.1f}"
            f"  {r['aside']:13.1f}"
        )
    if not args.ids:
        return
    print(f"ctr, mode=pserver workers=2 servers=2, {args.ids:,} ids (s, each epoch's checkpoint):")
    for epoch, (waited, tables) in enumerate(pserver_job(args.ids), 1):
        print(f"  epoch {epoch}: training waited {waited:.2f}, the servers' tables {tables:.2f}")


if __name__ == "__main__":
    main()
