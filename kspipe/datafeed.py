"""MultiSlot files and their DataFeedDesc: the data of the AsyncExecutor era.

A MultiSlot file has one instance per line.  For every slot of the desc, in the desc's
order, a line holds the number of values and then the values::

    1 0  3 4821 17 5133  4 0.5 0.1 -1.2 3.0
    ^ label (1 value)  ^ sparse ids (3)   ^ dense (4)

Slots are ``uint64`` (ids) or ``float``.  Sparse slots are variable-length (a LoD level);
dense slots have a fixed width.  Paddle's C++ reader (QueueDataset / InMemoryDataset)
parses these files in threads, but aborts the process on a malformed line and silently
trains on nothing when a file is missing, so kspipe checks the files first
(:func:`scan_files`) and names the file and line of the first mistake.

Here also: :class:`DataFeedDesc` (the seed's API), a Python reader of the same files
(evaluation and the Python-fed baseline), and :func:`convert` from CSV / JSON lines.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass

import numpy as np

from kspipe.errors import ConfigError, DataError

SLOT_TYPES = ("uint64", "float")
UINT64_LIMIT = 1 << 64


class DataFeedDesc:
    """A ``MultiSlotDataFeed`` description, read from a protobuf text file.

    The seed's API: ``set_batch_size``, ``set_dense_slots``, ``set_use_slots`` and
    ``desc()``.  By default no slot is dense and no slot is used, as the seed says;
    ``set_dense_slots`` / ``set_use_slots`` mark the named slots.
    """

    def __init__(self, proto_file: str):
        from google.protobuf import text_format
        from paddle.base.proto import data_feed_pb2

        try:
            with open(proto_file) as f:
                text = f.read()
        except OSError as err:
            raise DataError(f"DataFeedDesc file {proto_file}: {err.strerror}") from err
        self.proto_desc = data_feed_pb2.DataFeedDesc()
        try:
            text_format.Parse(text, self.proto_desc)
        except text_format.ParseError as err:  # its message starts with line:column
            raise DataError(f"DataFeedDesc file {proto_file}:{err}") from err
        self.path = proto_file
        self._check()

    @classmethod
    def from_text(cls, text: str, path: str) -> DataFeedDesc:
        """Write ``text`` to ``path`` and read it back."""
        with open(path, "w") as f:
            f.write(text)
        return cls(path)

    def _check(self) -> None:
        where = f"DataFeedDesc file {self.path}"
        if self.proto_desc.name != "MultiSlotDataFeed":
            raise DataError(f"{where}: name is {self.proto_desc.name!r}; kspipe reads "
                            f"MultiSlotDataFeed files")
        slots = self.proto_desc.multi_slot_desc.slots
        if not slots:
            raise DataError(f"{where}: multi_slot_desc has no slots")
        seen = set()
        for slot in slots:
            if not slot.name:
                raise DataError(f"{where}: a slot has no name")
            if slot.name in seen:
                raise DataError(f"{where}: slot {slot.name!r} appears twice")
            seen.add(slot.name)
            if slot.type not in SLOT_TYPES:
                raise DataError(f"{where}: slot {slot.name!r} has type {slot.type!r}; "
                                f"MultiSlot types are uint64 and float")

    def set_batch_size(self, batch_size: int) -> None:
        """The number of instances of a minibatch."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch size {batch_size!r} must be a positive integer")
        self.proto_desc.batch_size = batch_size

    def set_dense_slots(self, dense_slots_name) -> None:
        """Make these slots dense: fed as a fixed-width Tensor instead of a LoDTensor."""
        for slot in self._slots_named(dense_slots_name):
            slot.is_dense = True

    def set_use_slots(self, use_slots_name) -> None:
        """Feed these slots to the model; the others are read over and dropped."""
        for slot in self._slots_named(use_slots_name):
            slot.is_used = True

    def desc(self) -> str:
        """The protobuf message, as text."""
        from google.protobuf import text_format

        return text_format.MessageToString(self.proto_desc)

    def _slots_named(self, names) -> list:
        if isinstance(names, str):
            names = [names]
        by_name = {s.name: s for s in self.proto_desc.multi_slot_desc.slots}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ConfigError(f"no slot named {', '.join(map(repr, unknown))} in {self.path} "
                              f"(slots: {', '.join(by_name)})")
        return [by_name[n] for n in names]

    # --- what kspipe reads from it ----------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.proto_desc.batch_size

    @property
    def slots(self) -> list:
        """Every slot, in file order (protobuf ``Slot`` messages)."""
        return list(self.proto_desc.multi_slot_desc.slots)

    @property
    def used_slots(self) -> list:
        return [s for s in self.slots if s.is_used]

    def slot(self, name: str):
        return self._slots_named([name])[0]


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
        item = os.path.expanduser(str(item))
        if os.path.isdir(item):
            found = sorted(os.path.join(item, n) for n in os.listdir(item)
                           if not n.startswith(".") and os.path.isfile(os.path.join(item, n)))
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


def scan_files(files: list[str], desc: DataFeedDesc, check: bool = True,
               label: str | None = None) -> FileCounts:
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
                            values = parse_line(raw.decode("utf-8", "replace"), slots, widths,
                                                path, number)
                            if k is not None and (len(values[k]) != 1 or values[k][0] > 1):
                                raise DataError(
                                    f"{path}:{number}: label slot {label!r} holds "
                                    f"{' '.join(map(str, values[k]))}; a label is one 0 or 1")
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
            raise DataError(f"{where}: the line ends before slot {slot.name!r} "
                            f"({len(slots)} slots expected)")
        try:
            count = int(tokens[i])
        except ValueError:
            count = _int_token(tokens[i], where, f"the value count of slot {slot.name!r}")
        if count < 1:
            raise DataError(f"{where}: slot {slot.name!r} has {count} values; every slot needs "
                            f"at least one (pad empty sparse slots with an id such as 0)")
        chunk = tokens[i + 1:i + 1 + count]
        if len(chunk) < count:
            raise DataError(f"{where}: slot {slot.name!r} says {count} values but the line has "
                            f"only {len(chunk)} left")
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
                raise DataError(f"{where}: dense slot {slot.name!r} has {count} values, "
                                f"expected {expected}")
        values.append(chunk)
        i += 1 + count
    if i != len(tokens):
        raise DataError(f"{where}: {len(tokens) - i} values left after the last slot "
                        f"{slots[-1].name!r}")
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
                array.reshape(-1, 1), [[len(values) for values in column]], paddle.CPUPlace())
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


def hash_id(token: str) -> int:
    """A stable uint64 id for a categorical value that is not an integer."""
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")


def convert(input_path: str, desc: DataFeedDesc, output_dir: str, lines_per_file: int = 100_000,
            fmt: str | None = None) -> list[str]:
    """Write MultiSlot files for ``desc`` from raw records (CSV with a header, or JSON lines).

    Each slot is read from the column (or JSON key) of its name.  A uint64 value that is
    not an integer is hashed to one (categorical strings); a CSV cell or JSON list holds
    several values separated by spaces; an empty sparse slot becomes the single id 0 (the
    padding Paddle's reader needs).  Dense slots need every value.  Returns the files.
    """
    fmt = fmt or ("jsonl" if input_path.endswith((".jsonl", ".json")) else "csv")
    if fmt not in ("csv", "jsonl"):
        raise ConfigError(f"input format {fmt!r} must be csv or jsonl")
    slots = desc.slots
    os.makedirs(output_dir, exist_ok=True)
    written, out, count = [], None, 0
    try:
        for number, record in _records(input_path, fmt):
            values = [_slot_values(record, slot, f"{input_path}:{number}") for slot in slots]
            if out is None or count == lines_per_file:
                if out:
                    out.close()
                written.append(os.path.join(output_dir, f"part-{len(written):05d}"))
                out, count = open(written[-1], "w"), 0
            out.write(format_line(values, slots) + "\n")
            count += 1
    except BaseException:
        if out:
            out.close()
        for path in written:  # no half-converted data set is left to train on
            os.remove(path)
        raise
    if out:
        out.close()
    if not written:
        raise DataError(f"{input_path} has no records")
    return written


def _records(path: str, fmt: str):
    try:
        f = open(path, newline="")
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from err
    with f:
        if fmt == "csv":
            reader = csv.DictReader(f)
            for record in reader:
                yield reader.line_num, record
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{number}: not JSON ({err.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{number}: a JSON line must be an object")
                yield number, record


def _slot_values(record: dict, slot, where: str) -> list:
    raw = record.get(slot.name)
    if raw is None or raw == "":
        items = []
    elif isinstance(raw, list):
        items = raw
    elif isinstance(raw, str):
        items = raw.split()
    else:
        items = [raw]
    if slot.type == "float":
        if not items:
            raise DataError(f"{where}: no value for float slot {slot.name!r}")
        try:
            return [float(v) for v in items]
        except (TypeError, ValueError):
            raise DataError(f"{where}: slot {slot.name!r} is float but holds {raw!r}") from None
    ids = []
    for item in items:
        if isinstance(item, bool) or isinstance(item, float):
            raise DataError(f"{where}: slot {slot.name!r} is uint64 but holds {item!r}")
        text = str(item)
        ids.append(int(text) % UINT64_LIMIT if _is_int(text) else hash_id(text))
    return ids or [0]


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()
