"""Stage ``dataset``: MultiSlot files described by a DataFeedDesc (``stages.dataset=datafeed``).

``datafeed.desc`` names the DataFeedDesc text file and ``datafeed.train_files`` /
``datafeed.test_files`` the files (a folder, a glob or a list); left null, they are the
generated click-through set (:mod:`kspipe.datafeed.generated`).  Each worker takes its share of the
training files (``role.split_files``) and checks them before training: a malformed line,
a value of the wrong type, a missing file or an empty list is one clear error naming the
file and line, never an abort inside Paddle's C++ reader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kspipe import hookimpl
from kspipe.contracts import TrainingData
from kspipe.datafeed import generated
from kspipe.datafeed.config import DatafeedConfig
from kspipe.datafeed.desc import DataFeedDesc
from kspipe.datafeed.files import FileCounts, parse_line, resolve_files, scan_files
from kspipe.datafeed.formats import CRITEO_DESC, FORMATS, slot_desc
from kspipe.errors import ConfigError, DataError, check_integer
from kspipe.files import user_path
from kspipe.reporting import say

DATASETS = ("queue", "in_memory")


@dataclass
class FileDataset:
    """What the ``program`` and ``execute`` stages need to know of the files."""

    desc: DataFeedDesc
    label: str
    dense_width: dict  # dense slot name -> values per instance
    train_files: list = field(default_factory=list)  # this worker's share
    test_files: list = field(default_factory=list)
    train_counts: FileCounts | None = None
    test_counts: FileCounts | None = None
    threads: int = 1
    kind: str = "queue"
    training_data: TrainingData | None = None  # the run's input in its MLflow record

    @property
    def batch_size(self) -> int:
        return self.desc.batch_size


@hookimpl
def kspipe_config_schemas():
    return {"datafeed": DatafeedConfig}


@hookimpl
def kspipe_check_config(cfg):
    if cfg.stages.dataset != "datafeed":
        return
    d = cfg.datafeed
    if d.dataset not in DATASETS:
        raise ConfigError(f"datafeed.dataset={d.dataset!r} must be one of {', '.join(DATASETS)}")
    if d.format not in FORMATS:
        raise ConfigError(f"datafeed.format={d.format!r} must be one of {', '.join(FORMATS)}")
    if streamed(cfg):  # the files are the stream's passes (kspipe.ctr.stream)
        if d.desc is None and d.format == "multislot":
            raise ConfigError("ctr.stream of MultiSlot files needs datafeed.desc")
        check_integer(d.threads, "datafeed.threads", 1)
        return
    if d.format == "criteo" and d.train_files is None:
        raise ConfigError("datafeed.format=criteo reads datafeed.train_files: set them")
    if d.format != "criteo" and (d.desc is None) != (d.train_files is None):
        raise ConfigError(
            "datafeed.desc and datafeed.train_files go together: set both (and "
            "datafeed.test_files), or neither for the generated data set"
        )
    check_integer(d.threads, "datafeed.threads", 1)
    if d.train_files is not None and cfg.mode != "local":  # before a cluster is started
        from kspipe.cluster.endpoints import process_count

        check_files_per_worker(
            len(resolve_files(d.train_files, "datafeed.train_files")),
            process_count(cfg.workers, "workers"),
        )


def check_files_per_worker(files: int, workers: int) -> None:
    if files < workers:
        raise DataError(
            f"{files} training file(s) for {workers} workers: each worker reads "
            f"whole files, so give at least one file per worker"
        )


def streamed(cfg) -> bool:
    return cfg.get("ctr") is not None and cfg.ctr.stream.root is not None


@hookimpl
def kspipe_read_dataset(cfg, role):
    d = cfg.datafeed
    if streamed(cfg):
        return stream_dataset(cfg, role)
    built = generated.cached(cfg) if d.desc is None and d.format != "criteo" else None
    converted = os.path.join(user_path(cfg.run_dir or "."), "converted")
    if d.format == "criteo" and d.desc is None:
        os.makedirs(converted, exist_ok=True)
        desc = DataFeedDesc.from_text(CRITEO_DESC, os.path.join(converted, "criteo.prototxt"))
    else:
        desc = DataFeedDesc(
            user_path(d.desc) if d.desc else os.path.join(built, generated.DESC_NAME)
        )
    if d.batch_size is not None:
        desc.set_batch_size(d.batch_size)
    elif desc.batch_size < 1:
        raise ConfigError(f"{desc.path} sets no batch_size; set datafeed.batch_size")
    if d.dense_slots:
        desc.set_dense_slots(list(d.dense_slots))
    if d.use_slots:
        desc.set_use_slots(list(d.use_slots))
    label = check_label(desc, d.label)
    train = resolve_files(
        os.path.join(built, "train") if built else d.train_files, "datafeed.train_files"
    )
    test = resolve_files(
        os.path.join(built, "test") if built else d.test_files, "datafeed.test_files"
    )
    shapes = train  # the dense slots' widths: the first file's, as MultiSlot
    if d.format != "multislot":  # each process its own copy (a host may run several)
        shapes = as_multislot(d, desc, train[:1], converted, f"first-{os.getpid()}")
    dataset = FileDataset(desc, label, dense_widths(desc, shapes), kind=d.dataset)
    if role.is_server():  # servers need the slots' shapes only
        return dataset
    check_files_per_worker(len(train), role.worker_num())
    dataset.training_data = training_data(built, desc.path, train, test)
    dataset.train_files = role.split_files(train)
    dataset.test_files = test
    if d.format != "multislot":
        part = f"train-{os.getpid()}"
        dataset.train_files = as_multislot(d, desc, dataset.train_files, converted, part)
        if role.is_first_worker():
            dataset.test_files = as_multislot(d, desc, test, converted, "test")
    if d.validate:
        size = sum(os.path.getsize(p) for p in dataset.train_files) / 2**20
        say(
            f"checking {len(dataset.train_files)} training file(s) ({size:.1f} MiB) "
            f"line by line (datafeed.validate=false skips this)"
        )
    dataset.train_counts = scan_files(dataset.train_files, desc, check=d.validate, label=label)
    if role.is_first_worker():  # it evaluates
        dataset.test_counts = scan_files(dataset.test_files, desc, check=d.validate, label=label)
    dataset.threads = reader_threads(d.threads, len(dataset.train_files))
    return dataset


def stream_dataset(cfg, role) -> FileDataset:
    """A stream's data set: its desc (given, else made from the slots its first pass
    names: :func:`kspipe.datafeed.formats.slot_desc`), no files yet (each pass brings
    its own, :mod:`kspipe.ctr.stream.loop`)."""
    from kspipe.ctr.stream import layout

    d, s = cfg.datafeed, cfg.ctr.stream
    converted = os.path.join(user_path(cfg.run_dir or "."), "converted")
    os.makedirs(converted, exist_ok=True)
    first = []
    for day in layout.days(s):
        for p in layout.passes(s, day):
            if layout.present(s, p) or s.donefile is not None:
                first = layout.files(s, p)
            if first:
                break
        if first:
            break
    if not first:
        raise DataError(f"ctr.stream.root={s.root}: no pass of the stream holds a file")
    if d.desc is not None:
        desc = DataFeedDesc(user_path(d.desc))
    elif d.format == "criteo":
        desc = DataFeedDesc.from_text(CRITEO_DESC, os.path.join(converted, "criteo.prototxt"))
    else:
        text = slot_desc(first, d.label, d.label_slot, d.batch_size or 512)
        desc = DataFeedDesc.from_text(
            text, os.path.join(converted, f"slots-{os.getpid()}.prototxt")
        )
    if d.batch_size is not None:
        desc.set_batch_size(d.batch_size)
    label = check_label(desc, d.label)
    shapes = first[:1]
    if d.format != "multislot":
        shapes = as_multislot(d, desc, first[:1], converted, f"first-{os.getpid()}")
    dataset = FileDataset(desc, label, dense_widths(desc, shapes), kind=d.dataset)
    dataset.threads = d.threads
    if d.test_files is not None and role.is_first_worker():
        dataset.test_files = resolve_files(d.test_files, "datafeed.test_files")
        if d.format != "multislot":
            dataset.test_files = as_multislot(d, desc, dataset.test_files, converted, "test")
        dataset.test_counts = scan_files(dataset.test_files, desc, check=d.validate, label=label)
    root = user_path(s.root)
    dataset.training_data = TrainingData(
        os.path.basename(root.rstrip("/")), root, (desc.path,), profile={"stream": True}
    )
    return dataset


def as_multislot(d, desc, files: list, folder: str, part: str) -> list:
    """``files`` (of ``datafeed.format``) converted into MultiSlot files in ``folder``,
    one for each; a line that does not parse is one line naming its file and line."""
    from kspipe.datafeed.convert import write_multislot
    from kspipe.datafeed.formats import lines_as_multislot

    out = os.path.join(folder, part)
    os.makedirs(out, exist_ok=True)
    written = []
    for k, path in enumerate(files):
        target = os.path.join(out, f"part-{k:05d}")
        write_multislot(
            lines_as_multislot(path, d.format, desc, d.label, d.label_slot), desc, target
        )
        written.append(target)
    return written


def training_data(built: str | None, desc: str, train: list, test: list) -> TrainingData:
    """Every worker's training files, the test files and the desc, named by the folder
    they share (the generated set: ``ctr-generated``)."""
    files = (desc, *train, *test)
    source = os.path.commonpath([os.path.dirname(p) for p in files])
    name = "ctr-generated" if built else os.path.basename(source)
    profile = {"train_files": len(train), "test_files": len(test)}
    return TrainingData(name, source, tuple(files), profile=profile)


def check_label(desc: DataFeedDesc, name: str) -> str:
    slots = {s.name: s for s in desc.slots}
    if name not in slots:
        raise ConfigError(
            f"datafeed.label={name!r}: {desc.path} has no such slot (slots: {', '.join(slots)})"
        )
    slot = slots[name]
    if not slot.is_used:
        raise ConfigError(f"datafeed.label={name!r}: the slot is not used (is_used: false)")
    if slot.type != "uint64":
        raise ConfigError(
            f"datafeed.label={name!r}: a label slot holds 0/1 as uint64, not {slot.type}"
        )
    if len([s for s in desc.used_slots if s.name != name]) == 0:
        raise ConfigError(f"{desc.path}: no used slot besides the label {name!r}")
    return name


def dense_widths(desc: DataFeedDesc, files: list[str]) -> dict:
    """Each dense slot's width: declared in the desc (``shape``), else from the first line."""
    widths = {}
    for slot in desc.slots:
        dims = [d for d in slot.shape if d > 0]
        if slot.is_dense and dims:
            width = 1
            for d in dims:
                width *= d
            widths[slot.name] = width
    if all(not s.is_dense or s.name in widths for s in desc.slots):
        return widths
    try:
        with open(files[0]) as f:
            first = next((line for line in f if line.strip()), None)
    except OSError as err:
        raise DataError(f"cannot read {files[0]}: {err.strerror}") from err
    if first is None:
        raise DataError(
            f"{files[0]} is empty: cannot tell the width of the dense slots; "
            f"declare it in the desc (shape: -1 shape: N)"
        )
    parse_line(first, desc.slots, widths, files[0], 1)
    return widths


def reader_threads(threads: int, files: int) -> int:
    """Reader threads: each reads whole files, so at most this worker's file count."""
    if threads > files:
        say(
            f"datafeed.threads={threads} but this worker has {files} file(s); "
            f"each thread reads whole files, so {files} thread(s) will run"
        )
        return files
    return threads
