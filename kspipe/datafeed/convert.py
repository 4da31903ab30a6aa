"""Writing MultiSlot files from raw records (CSV with a header, or JSON lines)."""

from __future__ import annotations

import csv
import hashlib
import json
import os

from kspipe.datafeed.desc import UINT64_LIMIT, DataFeedDesc
from kspipe.datafeed.files import format_line
from kspipe.errors import ConfigError, DataError


def hash_id(token: str) -> int:
    """A stable uint64 id for a categorical value that is not an integer."""
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")


def convert(
    input_path: str,
    desc: DataFeedDesc,
    output_dir: str,
    lines_per_file: int = 100_000,
    fmt: str | None = None,
) -> list[str]:
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
    rows = (
        [_slot_values(record, slot, f"{input_path}:{number}") for slot in slots]
        for number, record in _records(input_path, fmt)
    )
    return write_parts(rows, slots, input_path, output_dir, lines_per_file)


def convert_log(
    input_path: str,
    desc_path: str,
    output_dir: str,
    fmt: str,
    lines_per_file: int = 100_000,
    label: str = "label",
    label_slot: int = 1,
) -> list[str]:
    """MultiSlot files from a click log in PaddleRec's slot format or Criteo's TSV
    (:mod:`kspipe.datafeed.formats`); for criteo, ``desc_path`` is written with its slots
    when it does not exist.  Returns the files."""
    from kspipe.datafeed.formats import CRITEO_DESC, lines_as_multislot

    if fmt == "criteo" and not os.path.exists(desc_path):
        desc = DataFeedDesc.from_text(CRITEO_DESC, desc_path)
    else:
        desc = DataFeedDesc(desc_path)
    if fmt == "slot" and label not in {s.name for s in desc.slots}:
        raise ConfigError(f"the desc {desc_path} has no label slot {label!r}")
    rows = lines_as_multislot(input_path, fmt, desc, label, label_slot)
    return write_parts(rows, desc.slots, input_path, output_dir, lines_per_file)


def write_parts(rows, slots, input_path: str, output_dir: str, lines_per_file: int) -> list[str]:
    """``rows`` (a slot's values each, read from ``input_path``) as MultiSlot files
    ``part-00000`` ... of ``lines_per_file`` lines in ``output_dir``; on any error none is
    left (no half-converted data set to train on).  Returns the files."""
    os.makedirs(output_dir, exist_ok=True)
    written, out, count = [], None, 0
    try:
        for values in rows:
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
        for path in written:
            os.remove(path)
        raise
    if out:
        out.close()
    if not written:
        raise DataError(f"{input_path} has no records")
    return written


def write_multislot(rows, desc: DataFeedDesc, path: str) -> None:
    """Write each of ``rows`` (a slot's values each) as a MultiSlot line to ``path``."""
    with open(path, "w") as out:
        for values in rows:
            out.write(format_line(values, desc.slots) + "\n")


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
