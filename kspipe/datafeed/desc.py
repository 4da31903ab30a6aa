"""The DataFeedDesc: which slots a MultiSlot file holds, their types, and which are used.

Slots are ``uint64`` (ids) or ``float``.  Sparse slots are variable-length (a LoD level);
dense slots have a fixed width.
"""

from __future__ import annotations

from kspipe.errors import ConfigError, DataError, check_integer

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
            raise DataError(
                f"{where}: name is {self.proto_desc.name!r}; kspipe reads MultiSlotDataFeed files"
            )
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
                raise DataError(
                    f"{where}: slot {slot.name!r} has type {slot.type!r}; "
                    f"MultiSlot types are uint64 and float"
                )

    def set_batch_size(self, batch_size: int) -> None:
        """The number of instances of a minibatch."""
        check_integer(batch_size, "batch_size", 1)
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
            raise ConfigError(
                f"no slot named {', '.join(map(repr, unknown))} in {self.path} "
                f"(slots: {', '.join(by_name)})"
            )
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
