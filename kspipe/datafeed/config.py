"""The ``datafeed`` config group: MultiSlot files read by Paddle's C++ reader threads
(``stages.dataset=datafeed``, as in ``kspipe +experiment=ctr_datafeed``).

:class:`DatafeedConfig` is the group's schema, which the plugin declares with
``kspipe_config_schemas`` (:mod:`kspipe.datafeed.plugin`): Hydra refuses a misspelt key or a
value of the wrong type while it composes the config; ranges are the workload's
``kspipe_check_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class GeneratedConfig:
    """The click-through set written when ``desc`` and ``train_files`` are null."""

    train_files: int = 8
    test_files: int = 2
    lines_per_file: int = 5000
    seed: int = 0
    cache_dir: Optional[str] = None  # default ~/.cache/kspipe (or $KSPIPE_CACHE_DIR)


@dataclass
class DatafeedConfig:
    """The files, their DataFeedDesc, and how they are read and reported."""

    desc: Optional[str] = None  # a DataFeedDesc text file (MultiSlotDataFeed);
    #                               null: the generated set's
    train_files: Any = None  # a folder, glob or list of MultiSlot files;
    #                               null: the generated set
    test_files: Any = None  # held-out files for the final evaluation
    batch_size: Optional[int] = None  # null: the desc's batch_size (set_batch_size)
    dense_slots: Optional[List[str]] = None  # slot names made dense (set_dense_slots)
    use_slots: Optional[List[str]] = None  # slot names marked used (set_use_slots)
    label: str = "label"  # the 0/1 uint64 slot that is the label
    # format: multislot (Paddle's) | slot (PaddleRec's feasign:slot lines) | criteo (Criteo's
    # raw TSV; desc null: its own slots): each worker converts its files into MultiSlot files
    # in the run folder first (kspipe datafeed convert does it ahead)
    format: str = "multislot"
    label_slot: int = 1  # format=slot: the slot number whose feasign is the label
    threads: int = 2  # reader/training threads per worker (each reads whole files)
    dataset: str = "queue"  # queue: streamed from the files | in_memory: loaded and shuffled
    validate: bool = True  # parse every line in Python first, to name a bad file and line
    # fetch: variables printed every print_period batches (loss: the model's loss),
    # into the progress line and MLflow as fetch_<name>
    fetch: List[str] = field(default_factory=lambda: ["loss"])
    print_period: int = 100
    print_period_s: float = 5  # seconds between progress lines (instances seen, running AUC)
    # profile: train_from_dataset's debug mode: every 100 batches its first thread prints
    # each op's mean seconds per batch (the servers' pulls and pushes included) on standard
    # error (a cluster role's: its log, <run_dir>/logs/worker.0.log)
    profile: bool = False
    generated: GeneratedConfig = field(default_factory=GeneratedConfig)
