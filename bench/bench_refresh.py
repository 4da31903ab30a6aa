"""The served model of a stream brought up to a delta (``kspipe ctr refresh``) against the
full model of that delta's save, at tables of millions of rows.

The saves are synthetic, in the servers' own format (the rows of SparseAdamSGDRule tables
as Paddle 2.6.2's servers write them, 6 significant digits; a base gzipped, a delta in
plain text; the manifest kspipe writes beside them; the workers' state): a real stream of
millions of ids takes hours on 2 cores.  For each size it writes a base of ``--rows`` rows
a table and a delta of ``--delta`` of them (half of its ids new, half already held),
builds the base's model (``--full``, timed), then times

* the full model at the delta: every row of the base and the delta parsed, merged, written;
* the refresh: the base's model read, the delta's rows merged in, written;

and checks that both give the same tables and tower.  ``--cluster`` also times the
stream's own full export at that size: a stream on 2 workers and 2 servers started from
the base (``init_from``), one pass of 200 lines and its day's end (no row evicted), then
its export (the servers write every row to find their ids, the first worker pulls every
row, the model is written): the seconds from its last save to the exported model.

    python bench/bench_refresh.py --rows 1000000 --tables 3 --out /tmp/bench-refresh
    python bench/bench_refresh.py --rows 10000000 --tables 1 --out /tmp/bench-refresh
    python bench/bench_refresh.py --rows 1000000 --tables 3 --cluster
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import time
from types import SimpleNamespace

import numpy as np

SERVERS = 2
EMBEDX = 7  # ctr.embedding_dim 8: embed_w and 7 values of embedx_w
RULE = ["SparseAdamSGDRule", "SparseAdamSGDRule", 0.9, 0.999]


def fresh_ids(rng, count: int, taken: np.ndarray) -> np.ndarray:
    """``count`` distinct uint64 ids over the whole range, none in ``taken`` nor 2**64-1."""
    found = np.zeros(0, np.uint64)
    while len(found) < count:
        more = rng.integers(0, 2**64 - 1, size=2 * (count - len(found)) + 16, dtype=np.uint64)
        found = np.unique(np.concatenate([found, np.setdiff1d(more, taken)]))
    return rng.permutation(found)[:count]


def write_rows(path: str, ids: np.ndarray, rng, gz: bool) -> None:
    """Rows of ``ids`` as a server writes them (id, slot, unseen days, delta score, show,
    click, embed_w, Adam's 4 values, 7 embedx_w, Adam's 16 values)."""
    import pandas as pd

    n = len(ids)
    weights = rng.uniform(-0.05, 0.05, size=(n, 1 + EMBEDX)).astype(np.float32)
    columns = {"id": ids.astype(np.uint64)}
    columns |= {f"h{k}": np.zeros(n, np.int8) for k in range(2)}
    columns |= {"score": np.full(n, 0.1, np.float32), "show": np.ones(n, np.float32)}
    columns |= {"click": np.zeros(n, np.int8), "embed_w": weights[:, 0]}
    columns |= {f"e{k}": np.full(n, v, np.float32) for k, v in enumerate([1e-3, 2e-6, 0.9, 0.999])}
    columns |= {f"x{k}": weights[:, 1 + k] for k in range(EMBEDX)}
    columns |= {f"s{k}": np.zeros(n, np.int8) for k in range(2 * EMBEDX)}
    columns |= {"b1": np.full(n, 0.9, np.float32), "b2": np.full(n, 0.999, np.float32)}
    frame = pd.DataFrame(columns)
    compression = {"method": "gzip", "compresslevel": 1} if gz else None
    frame.to_csv(
        path, sep=" ", header=False, index=False, float_format="%.6g", compression=compression
    )


def write_save(folder: str, number: int, kind: str, tables: dict, tower: dict, rng) -> str:
    """A stream's save ``checkpoint-<number>`` of ``tables`` (``{name: ids}``)."""
    from kspipe.checkpoint.tables import write_manifest

    found = os.path.join(folder, f"checkpoint-{number:07d}")
    layout = []
    for table_id, (name, ids) in enumerate(sorted(tables.items())):
        shards = os.path.join(found, "tables", f"{table_id:03d}")
        os.makedirs(shards)
        for server in range(SERVERS):
            mine = ids[ids % np.uint64(SERVERS) == server]
            gz = ".gz" if kind == "base" else ""
            write_rows(os.path.join(shards, f"part-{server:03d}-{server:05d}{gz}"), mine, rng, gz)
        layout.append([table_id, "MemorySparseTable", name, EMBEDX + 3, EMBEDX, [8] * 6])
    rules = {name: RULE for name in tables}
    write_manifest(os.path.join(found, "tables"), layout, SERVERS, rules)
    with open(os.path.join(found, "progress.json"), "w") as f:
        json.dump({"pass": number, "kind": kind}, f)
    with open(os.path.join(found, "state.pdparams"), "wb") as f:
        pickle.dump({k: v + np.float32(number) for k, v in tower.items()}, f)
    return found


def template(out: str, slots: list, base: str, rng) -> dict:
    """A stream model of empty tables over ``slots`` (sparse uint64 slots), serving the
    save ``base``; returns its tower, random."""
    import paddle

    from kspipe.ctr.model import infer_program, key_lookup
    from kspipe.ctr.stream.refresh import Model
    from kspipe.testing import compose_config

    cfg = compose_config(["+experiment=ctr_stream", "ctr.stream.root=/nowhere"])
    paddle.enable_static()
    model = Model.__new__(Model)
    model.cfg = cfg
    model.slots = [
        SimpleNamespace(name=s, dtype=paddle.int64, lod_level=1, shape=[-1, 1]) for s in slots
    ]
    used = [SimpleNamespace(name=s, type="uint64", is_dense=False) for s in slots]
    dataset = SimpleNamespace(desc=SimpleNamespace(used_slots=used), label=None, dense_width={})
    names = [f"emb_{s}" for s in slots]
    program, _ = infer_program(dataset, cfg.ctr, key_lookup({n: 0 for n in names}), hashed=False)
    tower = {
        v.name: rng.uniform(-0.1, 0.1, size=v.shape).astype(np.float32)
        for v in program.list_vars()
        if v.persistable and v.name.startswith("tower_")
    }
    model.tables = {
        n: (np.zeros(0, np.int64), np.zeros((0, EMBEDX + 1), np.float32)) for n in names
    }
    model.dense = tower
    model.write(out, base)
    return tower


def size_of(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def one_size(out: str, rows: int, tables: int, share: float, seed: int) -> dict:
    from kspipe.ctr.stream.refresh import Model, refresh

    rng = np.random.default_rng(seed)
    shutil.rmtree(out, ignore_errors=True)
    folder = os.path.join(out, "checkpoints")
    slots = [str(2 + k) for k in range(tables)]
    began = time.perf_counter()
    base_ids = {f"emb_{s}": fresh_ids(rng, rows, np.zeros(0, np.uint64)) for s in slots}
    delta_ids = {}
    for name, ids in base_ids.items():
        changed = int(rows * share)
        held = rng.choice(ids, size=changed - changed // 2, replace=False)
        delta_ids[name] = np.concatenate([held, fresh_ids(rng, changed // 2, ids)])
    model_dir = os.path.join(out, "template")
    os.makedirs(folder)
    base = os.path.join(folder, "checkpoint-0000001")
    tower = None
    # the tower first (the template's shapes), then the saves that hold it
    os.makedirs(os.path.join(base, "tables"))  # a placeholder manifest for the template
    write_placeholder(base)
    tower = template(model_dir, slots, base, rng)
    shutil.rmtree(base)
    base = write_save(folder, 1, "base", base_ids, tower, rng)
    delta = write_save(folder, 2, "delta", delta_ids, tower, rng)
    written = time.perf_counter() - began
    figures = {"rows": rows, "tables": tables, "delta_rows": sum(map(len, delta_ids.values()))}
    figures |= {"written_s": written, "base_mb": size_of(os.path.join(base, "tables")) / 1e6}
    figures["delta_mb"] = size_of(os.path.join(delta, "tables")) / 1e6
    served = os.path.join(out, "model-base")
    began = time.perf_counter()
    # the template serves a placeholder save: its base model is built --full
    refresh(model_dir, base, served, full=True)
    figures["base_full_s"] = time.perf_counter() - began
    figures["model_mb"] = size_of(served) / 1e6
    timed = {}
    for name, full, source in (("full_s", True, model_dir), ("refresh_s", False, served)):
        began = time.perf_counter()
        refresh(source, delta, os.path.join(out, name), full=full)
        timed[name] = time.perf_counter() - began
    figures |= timed
    a, b = Model(os.path.join(out, "full_s")), Model(os.path.join(out, "refresh_s"))
    for name, (keys, values) in a.tables.items():
        assert np.array_equal(b.tables[name][0], keys) and np.array_equal(b.tables[name][1], values)
        figures.setdefault("rows_after", 0)
        figures["rows_after"] += len(keys)
    assert all(np.array_equal(a.dense[n], b.dense[n]) for n in a.dense)
    return figures


def cluster_export(out: str, base: str) -> dict:
    """The stream's own export of the tables of ``base`` (see the module's docstring)."""
    from pathlib import Path

    from kspipe import checkpoint
    from kspipe.ctr.stream.generated import write_stream
    from kspipe.testing import begun_store, run_kspipe

    logs, run = os.path.join(out, "logs"), os.path.join(out, "cluster")
    shutil.rmtree(logs, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    write_stream(logs, "20190720", 1, ["0000", "0030"], 100)
    began = time.perf_counter()
    result = run_kspipe(
        "+experiment=ctr_stream",
        "workers=2",
        "servers=2",
        f"run_dir={run}",
        f"tracking.uri={begun_store(Path(out))}",
        f"init_from={base}",
        f"ctr.stream.root={logs}",
        "ctr.stream.start_day=20190720",
        "ctr.stream.end_day=20190720",
        "ctr.stream.split_interval=30",
        "ctr.stream.split_per_pass=2",
        "datafeed.format=slot",
        "datafeed.label_slot=1",
        "ctr.table.accessor.ctr_accessor_param.delete_threshold=0",
        "cluster.timeout_s=3600",
        "cluster.stall_seconds=3600",
        cwd=out,
        timeout=4 * 3600,
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    last = checkpoint.latest(os.path.join(run, "checkpoints"))
    saved = os.path.getmtime(os.path.join(last, "progress.json"))
    exported = os.path.getmtime(os.path.join(run, "inference_model", "model.pdiparams"))
    return {"cluster_export_s": exported - saved, "cluster_job_s": time.perf_counter() - began}


def write_placeholder(found: str) -> None:
    """A save of no row: what the template model serves until the base is written."""
    from kspipe.checkpoint.tables import write_manifest

    write_manifest(os.path.join(found, "tables"), [], SERVERS, {})
    with open(os.path.join(found, "progress.json"), "w") as f:
        json.dump({"pass": 1, "kind": "base"}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows a table in the base")
    parser.add_argument("--tables", type=int, default=3)
    parser.add_argument(
        "--delta", type=float, default=0.01, help="a delta's rows, share of a table"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/bench-refresh")
    parser.add_argument("--keep", action="store_true", help="keep the saves and models written")
    parser.add_argument("--cluster", action="store_true", help="and the stream's own export")
    args = parser.parse_args()
    out = os.path.join(args.out, f"{args.tables}x{args.rows}")
    f = one_size(out, args.rows, args.tables, args.delta, args.seed)
    if args.cluster:
        if args.tables != 3:
            raise SystemExit("--cluster: the generated stream has 3 slots: give --tables 3")
        f |= cluster_export(out, os.path.join(out, "checkpoints", "checkpoint-0000001"))
    print(
        f"{f['tables']} table(s) of {f['rows']:,} rows (base {f['base_mb']:.0f} MB gzipped), "
        f"a delta of {f['delta_rows']:,} rows ({f['delta_mb']:.1f} MB): saves written in "
        f"{f['written_s']:.0f} s; the base's model ({f['model_mb']:.0f} MB) in "
        f"{f['base_full_s']:.1f} s"
    )
    print(
        f"  full model at the delta: {f['full_s']:.1f} s; refresh from the base's model: "
        f"{f['refresh_s']:.1f} s ({f['full_s'] / f['refresh_s']:.1f}x); same "
        f"{f['rows_after']:,} rows and tower"
    )
    if args.cluster:
        print(
            f"  the stream's own export of the base's tables: {f['cluster_export_s']:.1f} s "
            f"(the whole job, init_from included: {f['cluster_job_s']:.0f} s)"
        )
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    with open(os.path.join(args.out, "figures.jsonl"), "a") as log:
        log.write(json.dumps(f) + "\n")


if __name__ == "__main__":
    main()
