"""A sparse table's update rule without a name is Paddle's default, SparseAdamSGDRule, and
the parameters given under ``adam`` are that rule's: they reach the servers (they were
dropped, so ``ctr.table.accessor.embed_sgd_param.adam.learning_rate=...`` did nothing).
Parameters given for a rule the table does not get are refused in one line."""

import gzip

import numpy as np
import pytest
from google.protobuf import json_format

from kspipe.checkpoint.tables import read_manifest
from kspipe.errors import ConfigError
from kspipe.testing import compose_config, run_kspipe

DESC = """name: "MultiSlotDataFeed"
batch_size: 8
multi_slot_desc {
  slots { name: "label" type: "uint64" is_used: true }
  slots { name: "user" type: "uint64" is_used: true }
}
"""
ADAM = "ctr.table.accessor.{}_sgd_param.adam.{}={}"


def test_adam_parameters_without_a_rule_name_reach_the_table():
    from paddle.distributed.fleet.proto import distributed_strategy_pb2

    from kspipe.ctr.tables import check_tables, server_tables

    cfg = compose_config(
        [
            "+experiment=ctr_datafeed",
            ADAM.format("embed", "learning_rate", 0.03),
            ADAM.format("embedx", "initial_range", 0.2),
        ]
    )
    check_tables(cfg)
    (ours,) = server_tables(cfg, ["emb_user"]).values()
    made = distributed_strategy_pb2.TableParameter()
    json_format.ParseDict(ours, made)
    embed, embedx = made.accessor.embed_sgd_param, made.accessor.embedx_sgd_param
    assert not embed.HasField("name")  # Paddle names it SparseAdamSGDRule
    assert embed.adam.learning_rate == pytest.approx(0.03)
    assert embedx.adam.initial_range == pytest.approx(0.2)


@pytest.mark.parametrize(
    "override, fragment",
    [
        (
            "ctr.table.accessor.embed_sgd_param.adagrad.learning_rate=0.05",
            "embed_sgd_param.adagrad.learning_rate is given but the rule is SparseAdamSGDRule "
            "(name null",
        ),
        (
            "ctr.table.accessor.embedx_sgd_param.name=SparseAdaGradSGDRule",
            "embedx_sgd_param.adam.learning_rate is given but the rule is SparseAdaGradSGDRule",
        ),
        ("ctr.table.accessor.embed_sgd_param.adam.learning_rate=-1", "must be >= 0"),
    ],
)
def test_parameters_of_another_rule_are_refused(override, fragment):
    from kspipe.ctr.tables import check_tables

    extra = ["ctr.table.accessor.embedx_sgd_param.adam.learning_rate=0.1"]
    cfg = compose_config(["+experiment=ctr_datafeed", override, *extra[: "embedx" in override]])
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        check_tables(cfg)


def test_a_zero_learning_rate_and_range_leave_every_row_zero(tmp_path):
    """On one server: rows created with initial_range 0 and never moved (learning rate 0)
    are zeros in the saved tables; had the rule's parameters been dropped, they would be
    drawn in +-0.05 and trained."""
    (tmp_path / "desc.prototxt").write_text(DESC)
    (tmp_path / "train").mkdir()
    rng = np.random.default_rng(0)
    lines = [f"1 {rng.integers(2)} 1 {rng.integers(1, 50)}" for _ in range(200)]
    (tmp_path / "train" / "part-0").write_text("\n".join(lines) + "\n")
    zero = [
        ADAM.format(p, k, 0)
        for p in ("embed", "embedx")
        for k in ("learning_rate", "initial_range")
    ]
    result = run_kspipe(
        "+experiment=ctr_datafeed",
        "mode=pserver",
        "workers=1",
        "servers=1",
        f"run_dir={tmp_path / 'run'}",
        "tracking.enabled=false",  # the servers' rows are what is checked
        f"datafeed.desc={tmp_path / 'desc.prototxt'}",
        f"datafeed.train_files={tmp_path / 'train'}",
        f"datafeed.test_files={tmp_path / 'train'}",
        "ctr.epochs=1",
        "cluster.timeout_s=120",
        *zero,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (checkpoint,) = (tmp_path / "run" / "checkpoints").iterdir()
    tables = checkpoint / "tables"
    (table_id,) = [t for t, kind, name, *_ in read_manifest(tables)["layout"] if name == "emb_user"]
    rows = {}
    for shard in (tables / f"{table_id:03d}").iterdir():
        with gzip.open(shard, "rt") as f:
            rows |= {int(v[0]): [float(x) for x in v[1:]] for v in map(str.split, f)}
    assert len(rows) == len(set(int(line.split()[3]) for line in lines))
    # after the id: 2 counters, delta score, show, click, embed_w, its Adam state (4),
    # embedx_w (7 values)
    assert all(fields[3] > 0 and fields[5] == 0 for fields in rows.values())
    assert all(fields[10:17] == [0.0] * 7 for fields in rows.values())
