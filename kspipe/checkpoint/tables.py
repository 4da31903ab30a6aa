"""The parameter servers' tables as a checkpoint holds them (its ``tables/`` folder): each
server's shard of every table, a manifest beside them, a sparse table's rows as text.

The servers write and load their shards themselves, as :mod:`kspipe.modes.ps.tables` asks
them to; this module knows the folder: the manifest written beside the shards, the checks
before a load, a sparse table's rows read or written as arrays, and the shards split anew
for another number of servers (:func:`reshard`).  It is in the core,
not with the mode, because a run in any mode reads a saved run's rows to start from its
model (:mod:`kspipe.checkpoint.incremental`), and a workload may not reach a mode.
"""

from __future__ import annotations

import json
import os
import re

from kspipe.errors import ConfigError

MANIFEST = "manifest.json"
SPARSE_TABLE = "MemorySparseTable"


def write_manifest(
    folder: str, layout: list, servers: int, rules: dict, dense_pushes: int = 0
) -> None:
    """``folder/manifest.json``: the tables' layout and rules, the servers, every file's
    size and the dense pushes the tables took (Adam's powers, which Paddle does not save)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(
            {
                "servers": servers,
                "layout": [list(t) for t in layout],
                "rules": rules,
                "files": files,
                "dense_pushes": dense_pushes,
            },
            f,
        )


def read_manifest(folder: str) -> dict:
    """The manifest of the tables in ``folder`` (checked by :func:`check_manifest`)."""
    with open(os.path.join(folder, MANIFEST)) as f:
        return json.load(f)


# --- a sparse table's rows in the servers' own files ---------------------------------
#
# A server writes each row of a sparse table (Paddle's CtrCommonAccessor) as one text line:
# the id, then slot, unseen days, delta score, show, click, embed_w, the embed rule's state,
# the embedx_w values and the embedx rule's state.  The embedding row a lookup returns is
# embed_w followed by embedx_w.  Row k lives on server k % servers.

HEADER = 5  # slot, unseen days, delta score, show, click


def rule_state(rule: str, width: int, beta1: float, beta2: float) -> list:
    """A fresh row's optimiser state under the server rule ``rule`` for ``width`` weights."""
    fresh = {
        "SparseNaiveSGDRule": [],
        "SparseAdaGradSGDRule": [0.0],
        "StdAdaGradSGDRule": [0.0] * width,
        "SparseAdamSGDRule": [0.0] * (2 * width) + [beta1, beta2],
        "SparseSharedAdamSGDRule": [0.0, 0.0, beta1, beta2],
    }
    if rule not in fresh:
        raise ConfigError(
            f"the servers' sparse rule {rule} is not one kspipe can write "
            f"rows for ({', '.join(fresh)})"
        )
    return fresh[rule]


def read_table_rows(folder: str) -> dict:
    """``{table name: (ids, embedding rows)}`` of every sparse table saved in ``folder``
    (checked against its manifest first)."""
    import gzip

    import numpy as np

    with open(os.path.join(folder, MANIFEST)) as f:
        saved = json.load(f)
    check_manifest(folder, None)
    progress = os.path.join(os.path.dirname(folder), "progress.json")
    if os.path.isfile(progress):
        with open(progress) as f:
            kind = json.load(f).get("kind")
        if kind == "delta":  # a stream's delta holds the rows trained since the save before
            raise ConfigError(
                f"{os.path.dirname(folder)} is a stream's delta (the rows of one pass), not "
                f"a whole model: start from a base (a checkpoint a day's end wrote)"
            )
    if "rules" not in saved:
        raise ConfigError(
            f"{os.path.join(folder, MANIFEST)}: written before kspipe recorded "
            f"the tables' rules: these tables can only be resumed"
        )
    tables = {}
    for table_id, _, name, _, embedx, _ in (t for t in saved["layout"] if t[1] == SPARSE_TABLE):
        embed_rule, _, beta1, beta2 = saved["rules"][name]
        embedx_at = HEADER + 1 + len(rule_state(embed_rule, 1, beta1, beta2))
        ids, rows = [], []
        shards = os.path.join(folder, f"{table_id:03d}")
        for file in sorted(os.listdir(shards)):
            with gzip.open(os.path.join(shards, file), "rt") as lines:
                for line in lines:
                    values = line.split()
                    ids.append(int(values[0]))
                    rows.append(
                        [values[1 + HEADER]] + values[1 + embedx_at : 1 + embedx_at + embedx]
                    )
        tables[name] = (
            np.array(ids, np.uint64),  # raw ids reach 2**64 - 1
            np.array(rows, np.float32).reshape(len(ids), embedx + 1),
        )
    return tables


def table_ids(folder: str) -> dict:
    """``{table name: the ids of its rows}`` (uint64) of every sparse table saved in
    ``folder``, read from the first column of its shards (no row parsed)."""
    import gzip

    import numpy as np

    saved = read_manifest(folder)
    found = {}
    for table_id, _, name, _, _, _ in (t for t in saved["layout"] if t[1] == SPARSE_TABLE):
        shards = os.path.join(folder, f"{table_id:03d}")
        ids = []
        for file in sorted(os.listdir(shards)):
            with gzip.open(os.path.join(shards, file), "rt") as lines:
                ids.extend(int(line.split(" ", 1)[0]) for line in lines)
        found[name] = np.array(ids, np.uint64)
    return found


def table_rows(folder: str) -> dict:
    """``{table name: rows}`` of every sparse table saved in ``folder`` (lines counted)."""
    import gzip

    saved = read_manifest(folder)
    counts = {}
    for table_id, _, name, _, _, _ in (t for t in saved["layout"] if t[1] == SPARSE_TABLE):
        shards = os.path.join(folder, f"{table_id:03d}")
        counts[name] = 0
        for file in os.listdir(shards):
            with gzip.open(os.path.join(shards, file), "rb") as f:
                counts[name] += sum(
                    chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")
                )
    return counts


def write_table_rows(folder: str, tables: dict, layout: list, rules: dict, servers: int) -> list:
    """Write ``tables`` (``{name: (ids, rows)}``) as the servers' files of the job's
    ``layout``, split over ``servers``; return the table ids written."""
    import gzip

    import numpy as np

    written = []
    for table_id, _, name, _, embedx, _ in (t for t in layout if t[1] == SPARSE_TABLE):
        if name not in tables:
            continue
        ids, rows = tables[name]
        embed_rule, embedx_rule, beta1, beta2 = rules[name]
        if rows.shape[1] != embedx + 1:
            raise ConfigError(
                f"table {name}: rows of width {rows.shape[1]} given, the servers hold {embedx + 1}"
            )
        embed_state = [repr(v) for v in rule_state(embed_rule, 1, beta1, beta2)]
        embedx_state = [repr(v) for v in rule_state(embedx_rule, embedx, beta1, beta2)]
        shards = os.path.join(folder, f"{table_id:03d}")
        os.makedirs(shards, exist_ok=True)
        for server in range(servers):
            with gzip.open(
                os.path.join(shards, f"part-{server:03d}-{server:05d}.gz"), "wt", compresslevel=1
            ) as f:
                for i in np.flatnonzero(ids % servers == server):
                    weights = [repr(float(v)) for v in rows[i]]
                    f.write(
                        " ".join(
                            [
                                str(int(ids[i])),
                                "0",
                                "0",
                                "0",
                                "0",
                                "0",
                                weights[0],
                                *embed_state,
                                *weights[1:],
                                *embedx_state,
                            ]
                        )
                        + "\n"
                    )
        written.append(table_id)
    return written


SHARD_FILE = re.compile(r"part-(\d+)")  # part-<server>.gz, part-<server>-<shard>.gz


def missing_shard(folder: str, layout: list, servers: int) -> str:
    """The first table shard that is not in ``folder`` (each server writes
    ``<table id>/part-<server>...`` of every table of values), as a message; '' if none is
    missing."""
    for table in layout:
        if not table[1].endswith(("SparseTable", "DenseTable")):
            continue  # tables that hold no values (the barrier table)
        shards = os.path.join(folder, f"{table[0]:03d}")
        names = os.listdir(shards) if os.path.isdir(shards) else []
        written = {int(m.group(1)) for m in map(SHARD_FILE.match, names) if m}
        for server in range(servers):
            if server not in written:
                return f"{shards}: server {server}'s shard of table {table[2]} is missing"
    return ""


def reshard(source: str, target: str, servers: int, layout: list) -> str:
    """The tables saved in ``source`` split anew for ``servers`` servers, written to
    ``target`` (replaced); returns ``target``.  ``layout`` is the job's: it must be the
    saved one but for the dense tables' slice widths, which follow the servers.

    A server's file holds whole values, one a line, with their optimiser state (a sparse
    row: its id, the accessor's show, click ... and the embed and embedx rules' state; a
    dense value: the parameter and its moments), so the lines move as they are, never
    parsed to numbers: a sparse row to server ``id % servers`` (one shard per server), a
    dense table's values in order, in the slices Paddle's client cuts
    (``size // servers + 1`` values each, the last one shorter).  Nothing is lost or
    rounded again: the copy holds every line of the source once.
    """
    import gzip
    import shutil

    saved = read_manifest(source)
    check_manifest(source, None)
    check_same_tables(os.path.join(source, MANIFEST), saved.get("layout", []), layout)
    partial = f"{target}.tmp"  # a copy cut short is never taken for a whole one
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    for table_id, kind, name, fea_dim, _, _ in layout:
        if not kind.endswith(("SparseTable", "DenseTable")):
            continue  # tables that hold no values (the barrier table)
        shards = os.path.join(source, f"{table_id:03d}")
        saved_files = [os.path.join(shards, file) for file in sorted(os.listdir(shards))]
        split = os.path.join(partial, f"{table_id:03d}")
        os.makedirs(split)
        if kind == SPARSE_TABLE:  # row by row: a table may not fit in memory
            outs = [
                gzip.open(os.path.join(split, f"part-{s:03d}-{s:05d}.gz"), "wt", compresslevel=1)
                for s in range(servers)
            ]
            try:
                for file in saved_files:
                    with gzip.open(file, "rt") as rows:
                        for row in rows:
                            outs[int(row.split(" ", 1)[0]) % servers].write(row)
            finally:
                for out in outs:
                    out.close()
            continue
        values = []
        for file in saved_files:
            with gzip.open(file, "rt") as f:
                values.extend(f)
        if len(values) != fea_dim:
            raise ConfigError(
                f"{shards}: dense table {name} has {len(values)} values saved, the model {fea_dim}"
            )
        per = fea_dim // servers + 1
        for s in range(servers):
            with gzip.open(os.path.join(split, f"part-{s:03d}.gz"), "wt") as f:
                f.writelines(values[s * per : (s + 1) * per])
    write_manifest(partial, layout, servers, saved.get("rules", {}), saved.get("dense_pushes", 0))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def check_same_tables(file: str, saved: list, layout: list) -> None:
    """One line, naming ``file``, when the ``saved`` layout is not the job's ``layout``
    but for the dense tables' widths of a slice (they follow the number of servers)."""

    def tables(layout):
        return [
            tuple(t[:5]) + (None if t[1].endswith("DenseTable") else tuple(t[5]),) for t in layout
        ]

    if tables(saved) != tables(layout):
        raise ConfigError(
            f"{file}: the tables were saved by another model (another table "
            f"layout: {saved} there, {[list(t) for t in layout]} here)"
        )


def check_manifest(folder: str, servers: int | None, layout: list | None = None) -> None:
    """One line, naming the file, for tables this job cannot load from ``folder`` (of
    another number of ``servers`` than the job's, if given, a shard missing or damaged,
    and, given the job's ``layout``, of another model)."""
    file = os.path.join(folder, MANIFEST)
    try:
        with open(file) as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"cannot read the servers' tables' manifest {file} "
            f"({type(err).__name__}): was the checkpoint written by a "
            f"mode=pserver job?"
        ) from err
    if servers is None:
        servers = saved.get("servers")
    if saved.get("servers") != servers:  # the job splits them anew first (reshard)
        raise ConfigError(
            f"{file}: the tables were saved by {saved.get('servers')} server(s), "
            f"these files are for {servers}"
        )
    if layout is not None and [
        tuple(t[:5]) + (tuple(t[5]),) for t in saved.get("layout", [])
    ] != list(layout):
        raise ConfigError(
            f"{file}: the tables were saved by another model (another table "
            f"layout: {saved.get('layout')} there, {[list(t) for t in layout]} "
            f"here)"
        )
    missing = missing_shard(folder, saved.get("layout", []), servers)
    if missing:
        raise ConfigError(missing)
    for name, size in sorted(saved.get("files", {}).items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: a server's table shard is missing")
        if os.path.getsize(path) != size:
            raise ConfigError(
                f"{path}: a server's table shard is damaged ({os.path.getsize(path)} "
                f"bytes, {size} were written)"
            )
