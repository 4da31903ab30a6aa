"""Feeding data to several devices, with the semantics of the Fluid-era ParallelExecutor
and DataFeeder (seed documents 001 and 002), for scripts that feed devices themselves.

* a **dict** feed is split across the devices along the batch dimension;
* a **list** feed gives one dict per device, as is;
* fewer samples than devices is an error, never a silent empty device;
* ``drop_last`` drops a short last batch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from kspipe.errors import DataError


def split_feed(feed, num_devices: int) -> list[dict]:
    """One feed dict per device: a dict is split along axis 0, a list is taken as is."""
    if num_devices < 1:
        raise DataError(f"num_devices={num_devices} must be at least 1")
    if isinstance(feed, (list, tuple)):
        if len(feed) != num_devices:
            raise DataError(
                f"a list feed needs one dict per device: got {len(feed)} dicts "
                f"for {num_devices} devices"
            )
        return [dict(f) for f in feed]
    sizes = {name: len(value) for name, value in feed.items()}
    if len(set(sizes.values())) > 1:
        raise DataError(f"the variables of a feed have different batch sizes: {sizes}")
    batch = next(iter(sizes.values()), 0)
    if batch < num_devices:
        raise DataError(
            f"a batch of {batch} samples cannot be split across {num_devices} "
            f"devices: feed at least one sample per device"
        )
    bounds = np.linspace(0, batch, num_devices + 1).astype(int)
    return [
        {name: np.asarray(value)[bounds[i] : bounds[i + 1]] for name, value in feed.items()}
        for i in range(num_devices)
    ]


class DataFeeder:
    """Turns mini-batches of samples (tuples, one item per variable) into feed dicts."""

    def __init__(self, feed_list: list, place=None, num_devices: int = 1):
        self.names = [v if isinstance(v, str) else v.name for v in feed_list]
        self.dtypes = [None if isinstance(v, str) else _numpy_dtype(v.dtype) for v in feed_list]
        self.place = place
        self.num_devices = num_devices

    def feed(self, iterable: Iterable) -> dict:
        """One feed dict from a mini-batch: an iterable of samples."""
        samples = list(iterable)
        if not samples:
            raise DataError("an empty mini-batch cannot be fed")
        out = {}
        for k, name in enumerate(self.names):
            try:
                column = np.stack([np.asarray(sample[k]) for sample in samples])
            except (IndexError, ValueError) as err:
                raise DataError(f"variable {name}: the samples do not stack ({err})") from err
            out[name] = column.astype(self.dtypes[k]) if self.dtypes[k] else column
        return out

    def feed_parallel(self, iterable: Iterable, num_places: int | None = None) -> list[dict]:
        """One feed dict per device, from one mini-batch per device."""
        batches = list(iterable)
        num_places = num_places or self.num_devices
        if len(batches) != num_places:
            raise DataError(
                f"feed_parallel needs one mini-batch per device: got "
                f"{len(batches)} for {num_places} devices"
            )
        return [self.feed(batch) for batch in batches]

    def decorate_reader(
        self,
        reader: Callable[[], Iterator],
        multi_devices: bool,
        num_places: int | None = None,
        drop_last: bool = True,
    ):
        """A reader of feed dicts (``multi_devices``: lists of one dict per device).

        ``reader`` yields mini-batches.  With several devices they are grouped, one per
        device; a last group (or, with one device, nothing) that is short is dropped with
        ``drop_last`` and is an error without it.
        """
        num_places = (num_places or self.num_devices) if multi_devices else 1

        def decorated():
            group = []
            for batch in reader():
                if not multi_devices:
                    yield self.feed(batch)
                    continue
                group.append(batch)
                if len(group) == num_places:
                    yield self.feed_parallel(group, num_places)
                    group = []
            if group and not drop_last:
                raise DataError(
                    f"the last {len(group)} mini-batch(es) cannot fill "
                    f"{num_places} devices; set drop_last=True to drop them"
                )

        return decorated


def _numpy_dtype(dtype) -> str | None:
    text = str(dtype).lower().replace("paddle.", "").replace("vartype.", "")
    return {
        "fp32": "float32",
        "float32": "float32",
        "fp64": "float64",
        "float64": "float64",
        "int64": "int64",
        "int32": "int32",
        "uint8": "uint8",
        "bool": "bool",
    }.get(text)
