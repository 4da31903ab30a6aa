"""A stream's served model brought up to a later save without a full export
(``kspipe ctr refresh``; docs/sparse-tables.md, "Serving what a stream built").

The exported model of a raw-id stream holds, per table, a sorted ``emb_<slot>.keys`` array
(the ids as int64) and its rows (then a row of zeros for unknown ids), and the tower's
dense parameters; ``stream.json`` beside it says which save it serves: the pass, and the
base its rows descend from (a fingerprint of that base's table manifest).  A refresh reads
the rows of every delta after that pass up to the checkpoint asked for (the deltas of the
same base), replaces the rows of the ids they hold and inserts the new ids in key order,
takes the tower from the checkpoint's state (the workers' parameters at that save), and
builds the inference program anew, since the tables' sizes are baked into it.

Evictions are not in deltas (a day's end deletes rows, then writes a base), so a refresh
across a base is refused in one line: a base is served by a full model, the rows of its
whole chain (``--full``: the base, then the deltas after it), as the stream's own export.

The rows come from the servers' text files, whose floats have 6 significant digits: a
model built from saves holds the rows a stream resumed there holds, which differ from the
live servers' (exported at a stream's end) in the seventh digit.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from kspipe import checkpoint
from kspipe.checkpoint.tables import HEADER, SPARSE_TABLE, read_manifest, rule_state
from kspipe.ctr.stream.saves import chain, progress_of
from kspipe.errors import ConfigError, DataError

#: Beside an exported stream model: the save it serves.
SERVED = "stream.json"


def fingerprint(found: str) -> str:
    """An id of the save ``found`` (its tables' manifest: every shard's size)."""
    with open(os.path.join(found, checkpoint.TABLES, "manifest.json"), "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:16]


def mark(model_dir: str, found: str) -> dict:
    """Write ``stream.json`` into ``model_dir``: the model serves the save ``found``."""
    served = {
        "pass": progress_of(found)["pass"],
        "checkpoint": os.path.basename(found),
        "base": fingerprint(chain(found)[0]),
    }
    with open(os.path.join(model_dir, SERVED), "w") as f:
        json.dump(served, f)
    return served


def served_save(model_dir: str) -> dict:
    path = os.path.join(model_dir, SERVED)
    if not os.path.isfile(path):
        raise ConfigError(
            f"{model_dir}: no {SERVED}: not the model of a stream (ctr.stream) that says "
            f"which save it serves"
        )
    with open(path) as f:
        return json.load(f)


def a_save(path: str) -> str:
    if not os.path.isfile(os.path.join(path, "progress.json")):
        raise ConfigError(f"{path}: not a stream's save (no progress.json)")
    return os.path.normpath(path)


def deltas_after(served: dict, found: str) -> list[str]:
    """The saves whose rows bring the model serving ``served`` up to ``found``: the
    deltas after its pass in ``found``'s chain; one line if a base lies between."""
    links = chain(found)
    name, progress = os.path.basename(found), progress_of(found)
    if progress.get("kind") == "base":
        raise ConfigError(
            f"{name} is a base: a day's end evicted rows, which no delta holds; serve it "
            f"with a full model (kspipe ctr refresh --full)"
        )
    if progress["pass"] <= served["pass"]:
        raise ConfigError(
            f"{name} (pass {progress['pass']}) is not after the save the model serves "
            f"({served['checkpoint']}, pass {served['pass']})"
        )
    if fingerprint(links[0]) != served["base"]:
        raise ConfigError(
            f"{name} follows the base {os.path.basename(links[0])}, not the one the model "
            f"serves ({served['checkpoint']}, pass {served['pass']}): a refresh cannot skip a "
            f"base (its evictions are in no delta); serve it with a full model (--full)"
        )
    return [
        link
        for link in links
        if progress_of(link).get("kind") != "base" and progress_of(link)["pass"] > served["pass"]
    ]


# --- rows -----------------------------------------------------------------------------


def saved_rows(found: str) -> dict:
    """``{table: (ids as int64, embedding rows)}`` of the sparse tables saved in the save
    ``found`` (a base's gzipped shards or a delta's text ones): each row's ``embed_w``
    then ``embedx_w`` (zeros where a row was saved without it)."""
    import pandas as pd

    folder = os.path.join(found, checkpoint.TABLES)
    saved = read_manifest(folder)
    tables = {}
    for table_id, _, name, _, embedx, _ in (t for t in saved["layout"] if t[1] == SPARSE_TABLE):
        embed_rule, embedx_rule, beta1, beta2 = saved["rules"][name]
        embedx_at = 1 + HEADER + 1 + len(rule_state(embed_rule, 1, beta1, beta2))
        width = embedx_at + embedx + len(rule_state(embedx_rule, embedx, beta1, beta2))
        wanted = [0, 1 + HEADER, *range(embedx_at, embedx_at + embedx)]
        shards = os.path.join(folder, f"{table_id:03d}")
        ids, rows = [np.zeros(0, np.uint64)], [np.zeros((0, embedx + 1), np.float32)]
        for file in sorted(os.listdir(shards)):
            path = os.path.join(shards, file)
            if os.path.getsize(path) == 0:
                continue
            try:
                frame = pd.read_csv(
                    path,
                    sep=" ",
                    header=None,
                    names=range(width),
                    usecols=wanted,
                    dtype={0: np.uint64},
                    compression="gzip" if file.endswith(".gz") else None,
                )
            except (ValueError, pd.errors.ParserError, OSError) as err:
                raise DataError(f"{path}: not a table shard kspipe can read ({err})") from None
            ids.append(frame[0].to_numpy(np.uint64))
            rows.append(np.nan_to_num(frame[wanted[1:]].to_numpy(np.float32)))
        tables[name] = (np.concatenate(ids).view(np.int64), np.concatenate(rows))
    return tables


def merge(keys: np.ndarray, rows: np.ndarray, ids: np.ndarray, new: np.ndarray):
    """``keys`` (ascending int64) and their ``rows`` with the rows ``new`` of ``ids`` in:
    an id held gets its new row, an id not held is inserted in key order."""
    order = np.argsort(ids, kind="stable")
    ids, new = ids[order], new[order]
    at = np.searchsorted(keys, ids)
    held = np.zeros(len(ids), bool)
    if len(keys):
        held = keys[np.minimum(at, len(keys) - 1)] == ids
    rows = rows.copy()
    rows[at[held]] = new[held]
    fresh = ~held
    return np.insert(keys, at[fresh], ids[fresh]), np.insert(rows, at[fresh], new[fresh], axis=0)


def as_saved(values: np.ndarray) -> np.ndarray:
    """``values`` as the servers save a dense table (6 significant digits, as C++ streams
    write a float) and a stream resumed from the save holds them."""
    flat = [float(f"{float(v):.6g}") for v in values.ravel()]
    return np.array(flat, values.dtype).reshape(values.shape)


# --- the model ------------------------------------------------------------------------


class Model:
    """An exported stream model in memory: its config, slots, tables and tower."""

    def __init__(self, model_dir: str):
        import paddle
        from omegaconf import OmegaConf

        from kspipe.inference import MODEL_NAME

        if not os.path.isfile(os.path.join(model_dir, MODEL_NAME + ".pdmodel")):
            raise ConfigError(f"{model_dir}: no exported model ({MODEL_NAME}.pdmodel) there")
        self.cfg = OmegaConf.load(os.path.join(model_dir, "kspipe_config.yaml"))
        paddle.enable_static()
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            program, self.feeds, _ = paddle.static.load_inference_model(
                os.path.join(model_dir, MODEL_NAME), paddle.static.Executor(paddle.CPUPlace())
            )
        block = program.global_block()
        self.slots = [block.var(name) for name in self.feeds]

        def value(name):
            return np.array(scope.find_var(name).get_tensor())

        names = [v.name for v in program.list_vars() if v.persistable]
        keyed = [n.removesuffix(".keys") for n in names if n.endswith(".keys")]
        if not keyed:
            raise ConfigError(f"{model_dir}: its tables are not looked up by raw id (ctr.ids=raw)")
        self.tables = {}
        for name in keyed:
            keys, rows = value(name + ".keys"), value(name)[:-1]  # the last row: unknown ids
            self.tables[name] = (keys[: len(rows)], rows)  # a table of no row keeps one key
        skip = set(keyed) | {n + ".keys" for n in keyed} | {"feed", "fetch"}
        self.dense = {n: value(n) for n in names if n not in skip}

    def take_tower(self, found: str) -> None:
        """The dense parameters as the workers held them at the save ``found``, to the
        digits the servers saved them with (what a stream resumed there pulls)."""
        state = checkpoint.read_arrays(os.path.join(found, "state.pdparams"), found)
        missing = sorted(set(self.dense) - set(state))
        if missing:
            raise ConfigError(f"{found}: its state has no {', '.join(missing)}: another model")
        for name, old in self.dense.items():
            if state[name].shape != old.shape:
                raise ConfigError(
                    f"{found}: {name} is {state[name].shape} there, {old.shape} in the model"
                )
            self.dense[name] = as_saved(np.asarray(state[name], old.dtype))

    def take_rows(self, found: str, start_empty: bool = False) -> int:
        """The rows of the save ``found`` merged in; returns how many it held."""
        counted = 0
        for name, (ids, rows) in saved_rows(found).items():
            if name not in self.tables:
                raise ConfigError(f"{found}: table {name} is not one of the model's")
            keys, held = self.tables[name]
            if start_empty:
                keys, held = keys[:0], held[:0]
            if rows.shape[1] != held.shape[1]:
                raise ConfigError(
                    f"{found}: table {name} has rows of {rows.shape[1]}, the model {held.shape[1]}"
                )
            self.tables[name] = merge(keys, held, ids, rows)
            counted += len(ids)
        return counted

    def write(self, out: str, found: str) -> dict:
        """The model as the stream exports it (:func:`kspipe.ctr.evaluation.pull_tables`)
        into ``out``, which serves the save ``found``."""
        import shutil
        from types import SimpleNamespace

        import paddle

        from kspipe.ctr.model import infer_program, key_lookup
        from kspipe.inference import export

        slots = [
            SimpleNamespace(
                name=var.name,
                type="uint64" if var.dtype == paddle.int64 else "float",
                is_dense=var.lod_level == 0,
            )
            for var in self.slots
        ]
        widths = {var.name: int(var.shape[-1]) for var in self.slots if var.lod_level == 0}
        dataset = SimpleNamespace(
            desc=SimpleNamespace(used_slots=slots), label=None, dense_width=widths
        )
        sizes = {name: len(keys) for name, (keys, _) in self.tables.items()}
        program, net = infer_program(dataset, self.cfg.ctr, key_lookup(sizes), hashed=False)
        place, scope = paddle.CPUPlace(), paddle.static.Scope()
        for name, (keys, rows) in self.tables.items():
            zeros = np.zeros((1, rows.shape[1]), np.float32)
            scope.var(name).get_tensor().set(np.concatenate([rows, zeros]), place)
            keys = keys if len(keys) else np.zeros(1, np.int64)  # a table of no row: one key
            scope.var(name + ".keys").get_tensor().set(keys, place)
        for name, value in self.dense.items():
            scope.var(name).get_tensor().set(value, place)
        partial = out.rstrip("/") + ".tmp"  # a model cut short is never taken for one
        shutil.rmtree(partial, ignore_errors=True)
        executor = paddle.static.Executor(place)
        export(self.cfg, partial, program, net["feeds"], [net["pred"]], executor, scope)
        served = mark(partial, found)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(partial, out)
        return served


def refresh(model_dir: str, found: str, out: str, full: bool = False) -> str:
    """Write into ``out`` the model of ``model_dir`` brought up to the stream's save
    ``found`` (a delta after the save it serves, of the same base); ``full``: the model of
    ``found``'s whole chain instead (``model_dir`` gives only its slots and config).
    Returns what was done, in one line."""
    import time

    began = time.perf_counter()
    found = a_save(found)
    model = Model(model_dir)
    if full:
        links = chain(found)
        rows = sum(model.take_rows(link, start_empty=i == 0) for i, link in enumerate(links))
        what = f"the rows of {len(links)} save(s) from {os.path.basename(links[0])}"
    else:
        links = deltas_after(served_save(model_dir), found)
        rows = sum(model.take_rows(link) for link in links)
        what = f"{rows} row(s) of {len(links)} delta(s) merged into {model_dir}"
    model.take_tower(found)
    served = model.write(out, found)
    held = sum(len(keys) for keys, _ in model.tables.values())
    return (
        f"wrote {out}: the model of {served['checkpoint']} (pass {served['pass']}), {what}; "
        f"tables hold {held} rows; {time.perf_counter() - began:.2f} s"
    )
