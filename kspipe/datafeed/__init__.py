"""MultiSlot files and their DataFeedDesc: the data of the AsyncExecutor era.

- :mod:`kspipe.datafeed.desc`: :class:`DataFeedDesc`, the seed's API over the protobuf text.
- :mod:`kspipe.datafeed.files`: finding files, checking every line, a Python reader.
- :mod:`kspipe.datafeed.convert`: MultiSlot files from CSV or JSON lines.
- :mod:`kspipe.datafeed.plugin`: the ``datafeed`` plugin (stage ``dataset``).
- :mod:`kspipe.datafeed.cli`: ``kspipe datafeed generate|convert|check``.
"""

from kspipe.datafeed.convert import convert, hash_id
from kspipe.datafeed.desc import DataFeedDesc
from kspipe.datafeed.files import (
    FileCounts,
    format_line,
    parse_line,
    python_batches,
    resolve_files,
    scan_files,
)

__all__ = [
    "DataFeedDesc",
    "FileCounts",
    "convert",
    "format_line",
    "hash_id",
    "parse_line",
    "python_batches",
    "resolve_files",
    "scan_files",
]
