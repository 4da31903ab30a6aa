"""The servers' sparse tables of the click-through model: ``ctr.table`` (PaddleRec's
``table_parameters`` of a table) checked in one line each and turned into the
``DistributedStrategy.sparse_table_configs`` entries fleet builds the tables from.

What Paddle 2.6.2 does with them (read in ``paddle/distributed/ps/the_one_ps.py`` and
``passes/ps_trainer_pass.py``, and seen on its servers; docs/sparse-tables.md):

* ``SparseAccessor`` is the CPU default: a looked-up row is ``embed_w`` then
  ``embedx_dim`` values of ``embedx_w``; the server keeps show and click beside it, and
  ``ctr_accessor_param`` scores, filters saves and evicts by them.  ``CtrCommonAccessor``
  puts show and click into the looked-up row for a model with a ``cvm`` op; kspipe's model
  has none, so it is refused.
* Show and click come from the variables a ``ShowClickEntry`` names: without one the
  trainer pass pushes show=1, click=0 for every id.  kspipe names its own (one show per
  instance, the label as click).  ``CountFilterEntry`` and ``ProbabilityEntry`` are
  accepted by Paddle and ignored by its CPU tables (an id seen once was admitted under
  ``CountFilterEntry(20)``), so they are refused here.
"""

from __future__ import annotations

from kspipe.errors import ConfigError

ACCESSORS = ("SparseAccessor",)
TABLE_CLASSES = ("MemorySparseTable",)
RULES = (
    "SparseNaiveSGDRule",
    "SparseAdaGradSGDRule",
    "StdAdaGradSGDRule",
    "SparseAdamSGDRule",
    "SparseSharedAdamSGDRule",
)
RULE_FIELD = {
    "SparseNaiveSGDRule": "naive",
    "SparseAdaGradSGDRule": "adagrad",
    "StdAdaGradSGDRule": "adagrad",
    "SparseAdamSGDRule": "adam",
    "SparseSharedAdamSGDRule": "adam",
}
#: The rule Paddle 2.6.2 gives a table whose rule has no name (``the_one_ps.py``, whatever
#: the accessor): the parameters under ``adam`` are then the ones that count.
DEFAULT_RULE = "SparseAdamSGDRule"
#: The show and click variables of the training program (ShowClickEntry's names).
SHOW, CLICK = "ctr_show", "ctr_click"
#: ctr_accessor_param's keys: (lowest, highest or None, the lowest excluded)
ACCESSOR_RANGES = {
    "nonclk_coeff": (0.0, None, False),
    "click_coeff": (0.0, None, False),
    "base_threshold": (0.0, None, False),
    "delta_threshold": (0.0, None, False),
    "delta_keep_days": (0.0, None, False),
    "show_click_decay_rate": (0.0, 1.0, True),
    "delete_threshold": (0.0, None, False),
    "delete_after_unseen_days": (0.0, None, False),
    "ssd_unseenday_threshold": (0.0, None, False),
}
REFUSED = {
    "CtrCommonAccessor": "it puts show and click into the looked-up row, for a model with a "
    "cvm op, which kspipe's ctr model has not; SparseAccessor keeps the same show, click, "
    "thresholds and eviction beside the row (leave accessor_class null)",
    "CtrDymfAccessor": "it is the GPU servers' accessor",
    "SSDSparseTable": "its save_persistables hung for over 200 s in Paddle 2.6.2: unproven",
}


def table_config(cfg, name: str):
    """The table parameters of the table ``name`` (``ctr.tables.<name>``, else ``ctr.table``)."""
    tables = cfg.ctr.get("tables") or {}
    return tables[name] if name in tables else cfg.ctr.table


def check_tables(cfg) -> None:
    """One line for a value of ``ctr.table`` (or ``ctr.tables.<name>``) Paddle would reject,
    ignore, or that kspipe's model cannot run, before anything starts."""
    m = cfg.ctr
    if m.ids not in ("raw", "hashed"):
        raise ConfigError(f"ctr.ids={m.ids!r} must be raw or hashed")
    checked = [("ctr.table", m.table)] + [
        (f"ctr.tables.{name}", t) for name, t in (m.get("tables") or {}).items()
    ]
    for key, table in checked:
        check_table(key, table, m.embedding_dim)


def check_table(key: str, t, embedding_dim: int) -> None:
    def refuse(what: str, value, allowed) -> None:
        reason = REFUSED.get(str(value))
        raise ConfigError(
            f"{key}.{what}={value!r}: "
            + (reason if reason else f"must be one of {', '.join(allowed)}")
        )

    if t.table_class is not None and t.table_class not in TABLE_CLASSES:
        refuse("table_class", t.table_class, TABLE_CLASSES)
    if t.shard_num is not None and t.shard_num < 1:
        raise ConfigError(f"{key}.shard_num={t.shard_num} must be at least 1")
    entry = str(t.entry)
    if entry != "show_click":
        raise ConfigError(
            f"{key}.entry={entry!r}: only show_click admits anything on Paddle 2.6.2's CPU "
            f"servers; CountFilterEntry and ProbabilityEntry are accepted there and ignored "
            f"(every id gets a row: Paddle issue 68324), so kspipe refuses them"
        )
    a = t.accessor
    if a.accessor_class is not None and a.accessor_class not in ACCESSORS:
        refuse("accessor.accessor_class", a.accessor_class, ACCESSORS)
    embedx = embedding_dim - 1
    if a.embedx_dim is not None and a.embedx_dim != embedx:
        raise ConfigError(
            f"{key}.accessor.embedx_dim={a.embedx_dim} with ctr.embedding_dim="
            f"{embedding_dim}: a SparseAccessor row is embed_w and embedx_dim values, so set "
            f"ctr.embedding_dim={a.embedx_dim + 1}"
        )
    if a.fea_dim is not None and a.fea_dim != embedx + 3:
        raise ConfigError(
            f"{key}.accessor.fea_dim={a.fea_dim}: a SparseAccessor row of "
            f"{embedding_dim} values is stored with show and click, fea_dim {embedx + 3}"
        )
    if a.embedx_threshold is not None and a.embedx_threshold < 0:
        raise ConfigError(f"{key}.accessor.embedx_threshold={a.embedx_threshold} must be >= 0")
    for part in ("embed_sgd_param", "embedx_sgd_param"):
        check_rule(f"{key}.accessor.{part}", a[part])
    for name, (low, high, open_low) in ACCESSOR_RANGES.items():
        value = a.ctr_accessor_param[name]
        if value is None:
            continue
        bad = value < low or (open_low and value == low) or (high is not None and value > high)
        if bad:
            bounds = f"{'above' if open_low else 'at least'} {low:g}" + (
                f" and at most {high:g}" if high is not None else ""
            )
            raise ConfigError(
                f"{key}.accessor.ctr_accessor_param.{name}={value:g} must be {bounds}"
            )


def rule_name(rule) -> str:
    """The update rule a table's ``embed_sgd_param`` or ``embedx_sgd_param`` gets."""
    return rule.name if rule.name is not None else DEFAULT_RULE


def check_rule(key: str, rule) -> None:
    if rule.name is not None and rule.name not in RULES:
        raise ConfigError(f"{key}.name={rule.name!r} must be one of {', '.join(RULES)}")
    name = rule_name(rule)
    kind = RULE_FIELD[name]
    for other in ("naive", "adagrad", "adam"):
        given = [k for k, v in rule[other].items() if v is not None]
        if other != kind and given:  # Paddle would build the rule without them
            raise ConfigError(
                f"{key}.{other}.{given[0]} is given but the rule is {name}"
                + (" (name null: Paddle's default)" if rule.name is None else "")
                + f", which takes {kind}.*: set {key}.name to the rule it is for"
            )
    params = rule[kind]
    for field in ("learning_rate", "initial_range", "initial_g2sum", "ada_epsilon"):
        value = params.get(field)
        if value is not None and value < 0:
            raise ConfigError(f"{key}.{kind}.{field}={value} must be >= 0")
    for field in ("beta1_decay_rate", "beta2_decay_rate"):
        value = params.get(field)
        if value is not None and not 0 <= value < 1:
            raise ConfigError(f"{key}.adam.{field}={value} must be in [0, 1)")
    bounds = params.get("weight_bounds")
    if bounds is not None and (len(bounds) != 2 or bounds[0] >= bounds[1]):
        raise ConfigError(f"{key}.{kind}.weight_bounds={list(bounds)} must be [low, high]")


def server_tables(cfg, names) -> dict:
    """``{table name: its parameters as a plain dict, nulls left out}`` for the servers
    (``role.distributed_optimizer(..., strategy={"tables": ...})``)."""
    from omegaconf import OmegaConf

    def given(node):
        if isinstance(node, dict):
            kept = {k: given(v) for k, v in node.items() if v is not None}
            return {k: v for k, v in kept.items() if v != {}}
        return node

    tables = {}
    for name in names:
        t = OmegaConf.to_container(table_config(cfg, name), resolve=True)
        t.pop("entry", None)
        for part in ("embed_sgd_param", "embedx_sgd_param"):
            rule = t["accessor"][part]
            # only the chosen rule's parameters travel (Paddle fills in the others' defaults);
            # a rule without a name is Paddle's default, whose parameters are adam's
            chosen = RULE_FIELD[rule.get("name") or DEFAULT_RULE]
            for kind in ("naive", "adagrad", "adam"):
                if kind != chosen:
                    rule.pop(kind)
        tables[name] = given(t)
    return tables


def collisions(dataset, hash_size: int) -> dict:
    """mode=local with ``ctr.ids=raw``: how hashing ids modulo ``hash_size`` folds this
    worker's training ids: ``{table name: (distinct ids, rows they use, share of the ids
    that share their row with another id)}``.  A cluster run keeps a row for each id, so
    this share is how far a local run's tables are from its."""
    import numpy as np

    from kspipe.datafeed.files import parse_line

    slots = dataset.desc.slots
    tables = {
        k: f"emb_{s.name}"
        for k, s in enumerate(slots)
        if s.is_used and s.type == "uint64" and s.name != dataset.label
    }
    seen = {name: set() for name in tables.values()}
    for path in dataset.train_files:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    values = parse_line(line, slots, dict(dataset.dense_width), path, number)
                    for k, name in tables.items():
                        seen[name].update(values[k])
    found = {}
    for name, ids in seen.items():
        rows = np.array(sorted(ids), dtype=np.uint64) % np.uint64(hash_size)
        _, counts = np.unique(rows, return_counts=True)
        shared = int(counts[counts > 1].sum())
        found[name] = (len(ids), len(counts), shared / max(len(ids), 1))
    return found


def report_collisions(dataset, hash_size: int, reporter) -> None:
    """Say and log (``table/<name>/ids``, ``table/<name>/collision_rate``) :func:`collisions`."""
    found = collisions(dataset, hash_size)
    metrics = {}
    for name, (ids, rows, share) in sorted(found.items()):
        reporter.say(
            f"table {name}: {ids} distinct ids hashed into {rows} of {hash_size} rows; "
            f"{share:.2%} of the ids share a row (mode=pserver keeps one for each)"
        )
        metrics.update({f"table/{name}/ids": ids, f"table/{name}/collision_rate": share})
    reporter.metrics(metrics, step=0)
