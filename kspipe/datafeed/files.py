"""Reading MultiSlot files: finding them, checking every line, and a Python reader.

A MultiSlot file has one instance per line.  For every slot of the desc, in the desc's
order, a line holds the number of values and then the values::

    1 0  3 4821 17 5133  4 0.5 0.1 -1.2 3.0
    ^ label (1 value)  ^ sparse ids (3)   ^ dense (4)

Paddle's C++ reader (QueueDataset / InMemoryDataset) parses these files in threads, but
aborts the process on a malformed line and silently trains on nothing when a file is
missing, so kspipe checks the files first (:func:`scan_files`) and names the file and
line of the first mistake.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass

import numpy as np

from kspipe.datafeed.desc import UINT64_LIMIT, DataFeedDesc
from kspipe.errors import ConfigError, DataError
from kspipe.files import user_path


@dataclass
class FileCounts:
    """What :func:`scan_files` learnt: instances per file, widths of the dense slots."""

    lines: dict  # path -> instances
    dense_width: dict  # dense slot name -> values per instance

    @property
    def total(self) -> int:
        return sum(self.lines.values())


def resolve_files(spec, key: str) -> list[str]:
    """``spec`` (a folder, a glob, a file, or a list of them) as a sorted list of files."""
    if spec is None:
        raise ConfigError(f"{key} is not set")
    items = [spec] if isinstance(spec, str) else list(spec)
    files = []
    for item in items:
        item = user_path(item)
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, n)
                for n in os.listdir(item)
                if not n.startswith(".") and os.path.isfile(os.path.join(item, n))
            )
            if not found:
                raise DataError(f"{key}: folder {item} has no files")
            files += found
        elif any(c in item for c in "*?["):
            found = sorted(p for p in glob.glob(item) if os.path.isfile(p))
            if not found:
                raise DataError(f"{key}: no file matches {item}")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise DataError(f"{key}: no such file: {item}")
    if not files:
        raise DataError(f"{key}: the file list is empty")
    return files


def scan_files(
    files: list[str], desc: DataFeedDesc, check: bool = True, label: str | None = None
) -> FileCounts:
    """Count each file's instances; with ``check``, parse every line as Paddle's reader would
    (and check that the slot ``label``, if given, holds one 0 or 1).

    Raises :class:`DataError` naming the file and line of the first malformed instance.
    """
    lines, widths, slots = {}, {}, desc.slots
    k = [s.name for s in slots].index(label) if label else None
    for path in files:
        count = 0
        try:
            with open(path, "rb") as f:
                if not check:
                    count = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
                else:
                    for number, raw in enumerate(f, 1):
                        if raw.strip():
                            values = parse_line(
                                raw.decode("utf-8", "replace"), slots, widths, path, number
                            )
                            if k is not None and (len(values[k]) != 1 or values[k][0] > 1):
                                raise DataError(
                                    f"{path}:{number}: label slot {label!r} holds "
                                    f"{' '.join(map(str, values[k]))}; a label is one 0 or 1"
                                )
                            count += 1
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror}") from err
        lines[path] = count
    return FileCounts(lines, widths)


def parse_line(line: str, slots, widths: dict, path: str = "<line>", number: int = 0) -> list:
    """The values of each slot of one MultiSlot line (ints for uint64, floats for float).

    ``widths`` holds the width of each dense slot; the first line that has one sets it.
    """
    tokens = line.split()
    values, i = [], 0
    where = f"{path}:{number}"
    for slot in slots:
        if i >= len(tokens):
            raise DataError(
                f"{where}: the line ends before slot {slot.name!r} ({len(slots)} slots expected)"
            )
        try:
            count = int(tokens[i])
        except ValueError:
            count = _int_token(tokens[i], where, f"the value count of slot {slot.name!r}")
        if count < 1:
            raise DataError(
                f"{where}: slot {slot.name!r} has {count} values; every slot needs "
                f"at least one (pad empty sparse slots with an id such as 0)"
            )
        chunk = tokens[i + 1 : i + 1 + count]
        if len(chunk) < count:
            raise DataError(
                f"{where}: slot {slot.name!r} says {count} values but the line has "
                f"only {len(chunk)} left"
            )
        try:  # the fast path; on a bad value, find and name it
            chunk = list(map(int if slot.type == "uint64" else float, chunk))
            if slot.type == "uint64" and (min(chunk) < 0 or max(chunk) >= UINT64_LIMIT):
                raise ValueError
        except ValueError:
            convert_token = _uint64_token if slot.type == "uint64" else _float_token
            chunk = [convert_token(t, where, slot.name) for t in chunk]
        if slot.is_dense:
            expected = widths.get(slot.name)
            if expected is None:
                expected = widths[slot.name] = _declared_width(slot) or count
            if count != expected:
                raise DataError(
                    f"{where}: dense slot {slot.name!r} has {count} values, expected {expected}"
                )
        values.append(chunk)
        i += 1 + count
    if i != len(tokens):
        raise DataError(
            f"{where}: {len(tokens) - i} values left after the last slot {slots[-1].name!r}"
        )
    return values


def _declared_width(slot) -> int | None:
    dims = [d for d in slot.shape if d > 0]
    return math.prod(dims) if dims else None


def _int_token(token: str, where: str, what: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise DataError(f"{where}: {what} is {token!r}, not an integer") from None


def _uint64_token(token: str, where: str, slot: str) -> int:
    try:
        value = int(token)
    except ValueError:
        raise DataError(f"{where}: slot {slot!r} is uint64 but holds {token!r}") from None
    if not 0 <= value < UINT64_LIMIT:
        raise DataError(f"{where}: slot {slot!r} holds {token}, outside uint64")
    return value


def _float_token(token: str, where: str, slot: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise DataError(f"{where}: slot {slot!r} is float but holds {token!r}") from None


# --- the Python reader --------------------------------------------------------------


def python_batches(files: list[str], desc: DataFeedDesc, batch_size: int, widths: dict):
    """Feed dicts of the used slots, ``batch_size`` instances each, read in Python.

    Sparse slots become LoDTensors (one sequence per instance); dense slots arrays of
    shape ``(batch, width)``.  The last batch may be short.
    """
    slots = desc.slots
    used = [(k, s) for k, s in enumerate(slots) if s.is_used]
    batch = []
    for path in files:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    batch.append(parse_line(line, slots, widths, path, number))
                    if len(batch) == batch_size:
                        yield _feed(batch, used)
                        batch = []
    if batch:
        yield _feed(batch, used)


def _feed(batch: list, used: list) -> dict:
    import paddle

    feed = {}
    for k, slot in used:
        column = [instance[k] for instance in batch]
        flat = [v for values in column for v in values]
        if slot.type == "uint64":  # ids above 2**63 wrap, as in Paddle's reader
            array = np.array(flat, dtype=np.uint64).view(np.int64)
        else:
            array = np.array(flat, dtype=np.float32)
        if slot.is_dense:
            feed[slot.name] = array.reshape(len(batch), -1)
        else:
            feed[slot.name] = paddle.base.create_lod_tensor(
                array.reshape(-1, 1), [[len(values) for values in column]], paddle.CPUPlace()
            )
    return feed


# --- writing MultiSlot files ----------------------------------------------------------


def format_line(values: list, slots) -> str:
    """One MultiSlot line from each slot's values."""
    parts = []
    for slot, chunk in zip(slots, values):
        parts.append(str(len(chunk)))
        if slot.type == "uint64":
            parts.extend(str(int(v)) for v in chunk)
        else:
            parts.extend(f"{float(v):.6g}" for v in chunk)
    return " ".join(parts)
