"""A stream's saves, and the tables rebuilt from them (docs/sparse-tables.md).

Each save is a kspipe checkpoint (``<run>/checkpoints/checkpoint-<pass>``: the workers'
state, ``progress.json`` and the servers' tables in ``tables/``, written aside and renamed
when complete).  Its ``tables/`` are one of Paddle's ``save_persistables`` modes:

* a **delta** (mode 1) after a pass: the rows whose delta score reached
  ``delta_threshold`` since the last delta (each such row's delta score then goes back to
  0 on its server), and the dense tables whole;
* a **base** (mode 0) at a day's end, after the eviction: every row.  (Paddle's mode 2
  base leaves out rows scoring below ``base_threshold`` or unseen for more than
  ``delta_keep_days``: it serves, it does not restore.)

The tables as they were after a save are its **chain** rebuilt: the last base at or before
it, then every delta after that base in order, a row of a later save replacing the same
row of an earlier one (a delta's rows with their delta score 0, as their servers set it
once written).  A row changes only when pushed, and a push scores at least
``min(nonclk_coeff, click_coeff)``, so with ``delta_threshold`` above 0 and at most that,
and ``base_threshold`` 0, every row trained since the last save is in the delta
(:func:`check_exact` refuses other thresholds).  Rows are deleted only at a day's end,
before its base.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

from kspipe import checkpoint
from kspipe.checkpoint.folders import checkpoints
from kspipe.checkpoint.tables import (
    SPARSE_TABLE,
    check_manifest,
    read_manifest,
    write_manifest,
)
from kspipe.errors import ConfigError, KspipeError

#: Paddle's save_persistables modes the stream writes.
DELTA_MODE, BASE_MODE = 1, 0
DELTA_SCORE_COLUMN = 3  # a saved row: id, slot, unseen days, delta score, show, click ...


def open_rows(path: str):
    """A saved shard's lines: a base's are gzipped, a delta's (mode 1) plain text."""
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def saved_ids(tables: str) -> dict:
    """``{table name: the ids of its rows}`` (uint64) of the sparse tables saved in
    ``tables`` (a base or a delta)."""
    import numpy as np

    found = {}
    for table_id, kind, name, *_ in read_manifest(tables)["layout"]:
        if kind != SPARSE_TABLE:
            continue
        shards = os.path.join(tables, f"{table_id:03d}")
        ids = []
        for file in sorted(os.listdir(shards)):
            with open_rows(os.path.join(shards, file)) as lines:
                ids.extend(int(line.split(" ", 1)[0]) for line in lines)
        found[name] = np.array(ids, np.uint64)
    return found


def progress_of(found: str) -> dict:
    with open(os.path.join(found, "progress.json")) as f:
        return json.load(f)


def chain(found: str) -> list[str]:
    """The checkpoints whose tables rebuild ``found``'s: the last base at or before it,
    then the deltas after it (every checkpoint up to ``found`` if there is no base)."""
    folder = os.path.dirname(found)
    earlier = [c for c in sorted(checkpoints(folder)) if c <= found]
    links = []
    for path in reversed(earlier):
        links.append(path)
        if progress_of(path).get("kind") == "base":
            break
    return links[::-1]


def broken(found: str) -> str:
    """Why the chain of ``found`` cannot rebuild its tables ('' if it can)."""
    for path in chain(found):
        try:
            check_manifest(os.path.join(path, checkpoint.TABLES), None)
        except KspipeError as err:
            return str(err)
    return ""


def intact(path: str, say) -> str:
    """The latest checkpoint at ``path`` (a run folder or a checkpoint) whose chain is
    whole: a save cut short is skipped, in one line."""
    found = checkpoint.latest(path)
    candidates = [c for c in sorted(checkpoints(os.path.dirname(found))) if c <= found]
    for candidate in reversed(candidates):
        reason = broken(candidate)
        if not reason:
            return candidate
        say(f"{os.path.basename(candidate)} cannot be resumed ({reason}): trying the one before")
    raise ConfigError(f"resume={path}: no save of the stream there is whole")


def rebuild(found: str, target: str) -> str:
    """The tables of ``found``'s chain, merged into ``target`` (replaced), as one save of
    every row the servers can load; returns ``target``."""
    links = chain(found)
    last = os.path.join(links[-1], checkpoint.TABLES)
    saved = read_manifest(last)
    partial = f"{target}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    for table_id, kind, *_ in saved["layout"]:
        if not kind.endswith(("SparseTable", "DenseTable")):
            continue
        name = f"{table_id:03d}"
        os.makedirs(os.path.join(partial, name))
        if kind != SPARSE_TABLE:  # dense tables: whole in every save, the last one's
            for file in os.listdir(os.path.join(last, name)):
                shutil.copy(os.path.join(last, name, file), os.path.join(partial, name, file))
            continue
        by_file: dict = {}  # a row stays in the file (server and shard) its id maps to
        for link in links:
            delta = progress_of(link).get("kind") != "base"
            shards = os.path.join(link, checkpoint.TABLES, name)
            for file in sorted(os.listdir(shards)):
                rows = by_file.setdefault(file.removesuffix(".gz") + ".gz", {})
                with open_rows(os.path.join(shards, file)) as lines:
                    for line in lines:
                        key, _, rest = line.partition(" ")
                        if delta:
                            fields = rest.split(" ")
                            fields[DELTA_SCORE_COLUMN - 1] = "0"
                            rest = " ".join(fields)
                        rows[key] = rest
        for file, rows in by_file.items():
            with gzip.open(os.path.join(partial, name, file), "wt", compresslevel=1) as out:
                out.writelines(f"{key} {rest}" for key, rest in rows.items())
    write_manifest(
        partial, saved["layout"], saved["servers"], saved["rules"], saved.get("dense_pushes", 0)
    )
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def prune(folder: str) -> None:
    """Remove the saves no resume needs: those before the second-to-last base."""
    bases = [c for c in sorted(checkpoints(folder)) if progress_of(c).get("kind") == "base"]
    if len(bases) < 2:
        return
    for old in (c for c in checkpoints(folder) if c < bases[-2]):
        shutil.rmtree(old, ignore_errors=True)


class HeldRows:
    """The ids each table holds, kept from the saves (no save of every row each pass):
    a base's ids, then each delta's added."""

    def __init__(self):
        self.ids: dict = {}

    def add(self, tables: str, base: bool) -> dict:
        import numpy as np

        found = saved_ids(tables)
        if base:
            self.ids = {name: np.unique(ids) for name, ids in found.items()}
        else:
            for name, ids in found.items():
                self.ids[name] = np.union1d(self.ids.get(name, ids[:0]), ids)
        return {name: len(ids) for name, ids in self.ids.items()}

    def restore(self, tables: str) -> None:
        self.add(tables, base=True)


def check_exact(cfg) -> None:
    """One line for table thresholds whose deltas would leave out trained rows (a stream
    resumed from them would not be the stream that was never stopped)."""
    checked = [("ctr.table", cfg.ctr.table)] + [
        (f"ctr.tables.{name}", t) for name, t in (cfg.ctr.get("tables") or {}).items()
    ]
    for key, t in checked:
        p = t.accessor.ctr_accessor_param
        nonclk = 0.1 if p.nonclk_coeff is None else p.nonclk_coeff
        click = 1.0 if p.click_coeff is None else p.click_coeff
        least = min(nonclk, click)
        if least <= 0:
            raise ConfigError(
                f"{key}.accessor.ctr_accessor_param: a stream needs nonclk_coeff and "
                f"click_coeff above 0 (a push scoring 0 is in no delta)"
            )
        if p.base_threshold:
            raise ConfigError(
                f"{key}.accessor.ctr_accessor_param.base_threshold={p.base_threshold:g}: a "
                f"stream's deltas must hold every row trained since the last save, and "
                f"Paddle leaves rows scoring below base_threshold out of them: set it to 0"
            )
        if p.delta_threshold is not None and p.delta_threshold > least:
            raise ConfigError(
                f"{key}.accessor.ctr_accessor_param.delta_threshold={p.delta_threshold:g}: "
                f"a stream's deltas must hold every row trained since the last save; a "
                f"row shown once scores {least:g} (min(nonclk_coeff, click_coeff)), so "
                f"set it to at most that (null: {least:g})"
            )


def with_delta_threshold(tables: dict) -> dict:
    """A stream's ``server_tables``: a table whose delta threshold is null gets half the
    least score of a push (Paddle's default, 0, would put every row in every delta)."""
    for t in tables.values():
        p = t.setdefault("accessor", {}).setdefault("ctr_accessor_param", {})
        if p.get("delta_threshold") is None:
            p["delta_threshold"] = min(p.get("nonclk_coeff", 0.1), p.get("click_coeff", 1.0)) / 2
    return tables
