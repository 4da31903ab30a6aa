"""The ``ctr`` config group: the click-through model of ``stages.program=ctr``.

:class:`CtrConfig` is the group's schema, which the plugin declares with
``kspipe_config_schemas`` (:mod:`kspipe.ctr.plugin`): Hydra refuses a misspelt key or a value
of the wrong type while it composes the config; ranges are
:func:`kspipe.ctr.tables.check_tables` and :func:`kspipe.ctr.plugin.kspipe_check_config`.

``ctr.table`` is PaddleRec's ``table_parameters`` block of one table (what goes under its
``embedding:``), key for key: pasted there, it builds the same table on the servers
(docs/sparse-tables.md).  Keys left null take Paddle 2.6.2's own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class NaiveRule:
    learning_rate: Optional[float] = None  # null: the optimiser's (ctr.learning_rate)
    initial_range: Optional[float] = None  # null: the model's initializer's (0.05)
    weight_bounds: Optional[List[float]] = None  # null: [-10, 10]


@dataclass
class AdagradRule:
    learning_rate: Optional[float] = None  # null: 0.05 (Paddle's default)
    initial_g2sum: Optional[float] = None  # null: 3.0
    initial_range: Optional[float] = None  # null: 0.0001
    weight_bounds: Optional[List[float]] = None  # null: [-10, 10]


@dataclass
class AdamRule:
    learning_rate: Optional[float] = None  # null: the optimiser's (ctr.learning_rate)
    initial_range: Optional[float] = None  # null: the model's initializer's (0.05)
    beta1_decay_rate: Optional[float] = None  # null: 0.9
    beta2_decay_rate: Optional[float] = None  # null: 0.999
    ada_epsilon: Optional[float] = None  # null: 1e-8
    weight_bounds: Optional[List[float]] = None  # null: [-10, 10]


@dataclass
class SgdParam:
    """A server-side update rule of a row's embed_w (``embed_sgd_param``) or of its
    embedx_w (``embedx_sgd_param``)."""

    # null: from the optimiser (Adam: SparseAdamSGDRule) | SparseNaiveSGDRule |
    # SparseAdaGradSGDRule | StdAdaGradSGDRule | SparseAdamSGDRule | SparseSharedAdamSGDRule
    name: Optional[str] = None
    naive: NaiveRule = field(default_factory=NaiveRule)
    adagrad: AdagradRule = field(default_factory=AdagradRule)
    adam: AdamRule = field(default_factory=AdamRule)


@dataclass
class CtrAccessorParam:
    """The accessor's show/click score, save filters and eviction.  A row's score is
    ``nonclk_coeff * (show - click) + click_coeff * click``."""

    nonclk_coeff: Optional[float] = None  # null: 0.1
    click_coeff: Optional[float] = None  # null: 1.0
    base_threshold: Optional[float] = None  # null: 0; a base save keeps rows scoring at least this
    delta_threshold: Optional[float] = None  # null: 0; a delta keeps rows whose score grew this
    delta_keep_days: Optional[float] = None  # null: 16; and seen within this many days
    show_click_decay_rate: Optional[float] = None  # null: 1 (no decay); each shrink multiplies
    #                                              show and click by it
    delete_threshold: Optional[float] = None  # null: 0; a shrink deletes rows scoring below it
    delete_after_unseen_days: Optional[float] = None  # null: 30; ... or unseen for longer
    ssd_unseenday_threshold: Optional[int] = None  # null: 1 (SSD tables only)


@dataclass
class AccessorConfig:
    # null: SparseAccessor (Paddle's CPU default, the one kspipe's model is built for)
    accessor_class: Optional[str] = None
    fea_dim: Optional[int] = None  # null: embedding width + 2 (SparseAccessor); checked if given
    embedx_dim: Optional[int] = None  # null: ctr.embedding_dim - 1; given: the width follows it
    embedx_threshold: Optional[float] = None  # null: 0; a row's embedx_w is trained (and pulled
    #                                           non-zero) once its score reaches this
    embed_sgd_param: SgdParam = field(default_factory=SgdParam)
    embedx_sgd_param: SgdParam = field(default_factory=SgdParam)
    ctr_accessor_param: CtrAccessorParam = field(default_factory=CtrAccessorParam)


@dataclass
class TableConfig:
    """One sparse table on the servers, as PaddleRec's ``table_parameters`` writes it."""

    table_class: Optional[str] = None  # null: MemorySparseTable (the only CPU table kspipe runs)
    shard_num: Optional[int] = None  # null: one shard per server (Paddle's own default is 1000)
    accessor: AccessorConfig = field(default_factory=AccessorConfig)
    # which rows the servers create: show_click (every id, show and click pushed with it:
    # one show per instance, the label as click); count_filter:N and probability:P are
    # refused (Paddle 2.6.2's CPU tables accept and ignore them)
    entry: str = "show_click"


@dataclass
class StreamConfig:
    """Day-by-day training over PaddleRec's online layout ``<root>/<YYYYMMDD>/<HHMM>/``
    (docs/sparse-tables.md): passes of ``split_per_pass`` folders ``split_interval``
    minutes apart, each trained once, validated on before it is trained on, saved as a
    delta; each day ends with the eviction and a base save."""

    root: Optional[str] = None  # the layout's folder; null: no stream (ctr.epochs over files)
    start_day: Optional[str] = None  # YYYYMMDD, the first day (null: the first day folder)
    end_day: Optional[str] = None  # YYYYMMDD, the last day included (null: start_day)
    split_interval: int = 5  # minutes between two HHMM folders (divides 1440)
    split_per_pass: int = 1  # HHMM folders a pass trains on
    # donefile: a file each HHMM folder gets once its data is complete (PaddleRec's
    # data_donefile); given, a pass waits for it in each of its folders; null: the folders
    # are complete (and a day folder missing is refused before anything starts)
    donefile: Optional[str] = None
    data_sleep_second: float = 10  # seconds between two looks for a donefile
    data_timeout_s: float = 3600  # a donefile not there after this long ends the stream
    save_delta_frequency: int = 1  # a delta save every this many passes (resume points)
    # dump_tables: after each pass's save (and a resume's restore) every row is also
    # written into <run>/stream-tables/ (pass-<n>, restored-<n>): to compare runs
    dump_tables: bool = False


@dataclass
class CtrConfig:
    """Embedding tables per slot, a ReLU tower, and Adam."""

    embedding_dim: int = 8
    # ids: raw: on parameter servers every uint64 id keeps a row of its own (ids at and above
    # 2**63 included) and hash_size is not applied; mode=local hashes ids modulo hash_size
    # and reports the share of ids that collide | hashed: ids modulo hash_size in every mode
    # (a local run and a cluster run then train the same tables)
    ids: str = "raw"
    hash_size: int = 262144  # rows of each slot's table where ids are hashed (see ids)
    hidden: List[int] = field(default_factory=lambda: [64, 32])  # the tower's ReLU layers
    learning_rate: float = 0.002
    epochs: int = 2
    # every table's parameters on the servers (PaddleRec's table_parameters block of a table)
    table: TableConfig = field(default_factory=TableConfig)
    # per table where slots differ, by table name (emb_<slot>): a whole TableConfig each,
    # replacing ctr.table for that table
    tables: Dict[str, TableConfig] = field(default_factory=dict)
    # shrink: at each day's end (here: each epoch's) the servers decay show and click and
    # delete rows below delete_threshold or unseen for delete_after_unseen_days
    shrink: bool = False
    # stream: train day by day over a PaddleRec online layout instead of ctr.epochs
    stream: StreamConfig = field(default_factory=StreamConfig)
