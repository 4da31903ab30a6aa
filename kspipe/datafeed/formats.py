"""Real click logs as MultiSlot lines: PaddleRec's slot format and Criteo's raw TSV.

* **slot** (PaddleRec's ``slot_dnn``): a line of ``value:slot`` tokens.  A token whose
  slot is a number is an id (``feasign:slot``) of the desc's uint64 slot of that name; the
  label is the feasign of slot ``label_slot`` (a number, ``datafeed.label_slot``); a token
  whose slot is a name (``dense_feature:0.05`` is written ``0.05:dense_feature`` or, as
  PaddleRec writes it, ``dense_feature:0.05``) is a value of the float slot of that name.
  A slot a line does not mention is the single id 0 (the padding Paddle's reader needs).
* **criteo** (Criteo's Kaggle/Terabyte TSV): the label, 13 integer counts, 26 hexadecimal
  categoricals, tab-separated.  The counts become the dense float slot ``dense`` (13
  values, a missing count 0); categorical ``C<k>`` becomes the uint64 id of a stable hash
  of ``C<k>`` and its value (:func:`criteo_id`, blake2b: the same on every machine and run),
  a missing value the id of ``C<k>`` and the empty string (its own id, per slot).

A line that does not parse is a one-line :class:`~kspipe.errors.DataError` naming its file
and line.
"""

from __future__ import annotations

import hashlib

from kspipe.errors import DataError

FORMATS = ("multislot", "slot", "criteo")
CRITEO_INTS, CRITEO_CATEGORICALS = 13, 26

CRITEO_DESC = (
    'name: "MultiSlotDataFeed"\nbatch_size: 512\nmulti_slot_desc {\n'
    '  slots { name: "label" type: "uint64" is_dense: false is_used: true }\n'
    '  slots { name: "dense" type: "float" is_dense: true is_used: true shape: -1 '
    f"shape: {CRITEO_INTS} }}\n"
    + "".join(
        f'  slots {{ name: "C{k}" type: "uint64" is_dense: false is_used: true }}\n'
        for k in range(1, CRITEO_CATEGORICALS + 1)
    )
    + "}\n"
)


def criteo_id(slot: str, value: str) -> int:
    """The uint64 id of categorical ``value`` in ``slot`` (``C1``..``C26``)."""
    digest = hashlib.blake2b(f"{slot}\x1f{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def criteo_values(line: str, where: str) -> list:
    """One Criteo TSV line as the values of :data:`CRITEO_DESC`'s slots."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != 1 + CRITEO_INTS + CRITEO_CATEGORICALS:
        raise DataError(
            f"{where}: {len(fields)} tab-separated fields; a Criteo line has "
            f"{1 + CRITEO_INTS + CRITEO_CATEGORICALS} (label, 13 counts, 26 categoricals)"
        )
    if fields[0] not in ("0", "1"):
        raise DataError(f"{where}: the label is {fields[0]!r}, not 0 or 1")
    counts = []
    for k, text in enumerate(fields[1 : 1 + CRITEO_INTS], 1):
        try:
            counts.append(float(int(text)) if text else 0.0)
        except ValueError:
            raise DataError(f"{where}: count I{k} is {text!r}, not an integer") from None
    values = [[int(fields[0])], counts]
    for k, text in enumerate(fields[1 + CRITEO_INTS :], 1):
        if text and not all(c in "0123456789abcdefABCDEF" for c in text):
            raise DataError(f"{where}: categorical C{k} is {text!r}, not hexadecimal")
        values.append([criteo_id(f"C{k}", text.lower())])
    return values


def slot_values(line: str, slots, label: str, label_slot: int, where: str) -> list:
    """One line of PaddleRec's slot format as the values of the desc's ``slots``."""
    by_name = {s.name: k for k, s in enumerate(slots)}
    values = [[] for _ in slots]
    for token in line.split():
        value, sep, slot = token.rpartition(":")
        if not sep or not value:
            raise DataError(f"{where}: token {token!r} is not value:slot")
        if value in by_name and not value.isdigit():  # PaddleRec's dense_feature:0.05
            value, slot = slot, value
        name = label if slot.isdigit() and int(slot) == label_slot else slot
        if name not in by_name:
            continue  # a slot the desc does not read
        k = by_name[name]
        if slots[k].type == "uint64":
            if not value.isdigit() or int(value) >= 1 << 64:
                raise DataError(f"{where}: slot {slot} holds {value!r}, not a uint64 id")
            values[k].append(int(value))
        else:
            try:
                values[k].append(float(value))
            except ValueError:
                raise DataError(f"{where}: slot {slot} holds {value!r}, not a number") from None
    if not values[by_name[label]]:
        raise DataError(f"{where}: no label (slot {label_slot})")
    if values[by_name[label]][0] not in (0, 1) or len(values[by_name[label]]) != 1:
        raise DataError(f"{where}: the label (slot {label_slot}) is not one 0 or 1")
    for k, slot in enumerate(slots):
        if not values[k]:
            if slot.type != "uint64":
                raise DataError(f"{where}: no value for float slot {slot.name!r}")
            values[k] = [0]
    return values


def slot_desc(files: list, label: str, label_slot: int, batch_size: int) -> str:
    """A DataFeedDesc (text) of the uint64 slots the slot-format ``files`` name (their
    first 1000 lines), by number, the label slot as ``label``."""
    numbers = set()
    for path in files:
        with open(path, errors="replace") as f:
            for _, line in zip(range(1000), f):
                for token in line.split():
                    slot = token.rpartition(":")[2]
                    if slot.isdigit() and int(slot) != label_slot:
                        numbers.add(int(slot))
    if not numbers:
        raise DataError(
            f"{files[0]}: no feasign:slot token besides the label's (slot {label_slot})"
        )
    slots = [f'  slots {{ name: "{label}" type: "uint64" is_dense: false is_used: true }}\n']
    slots += [
        f'  slots {{ name: "{n}" type: "uint64" is_dense: false is_used: true }}\n'
        for n in sorted(numbers)
    ]
    return (
        f'name: "MultiSlotDataFeed"\nbatch_size: {batch_size}\nmulti_slot_desc {{\n'
        + "".join(slots)
        + "}\n"
    )


def lines_as_multislot(path: str, fmt: str, desc, label: str, label_slot: int):
    """Each line of ``path`` (format ``fmt``) as MultiSlot values of ``desc``'s slots."""
    slots = desc.slots
    try:
        f = open(path, errors="replace")
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from err
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            if fmt == "criteo":
                yield criteo_values(line, where)
            else:
                yield slot_values(line, slots, label, label_slot, where)
