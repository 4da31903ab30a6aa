"""ctr's sparse tables as a production recommender runs them (issue 48): raw uint64 ids
on the servers (a row each, ids at and above 2**63 included), PaddleRec's table
parameters, real show and click, and what mode=local does with raw ids.  Each test checks
the servers' saved rows or the exported model against a computation over the data."""

import gzip
import json
import os

import numpy as np
import pytest
from google.protobuf import json_format

from kspipe.checkpoint.tables import read_manifest
from kspipe.testing import assert_one_line_error, begun_store, compose_config, run_kspipe

DESC = """name: "MultiSlotDataFeed"
batch_size: 8
multi_slot_desc {
  slots { name: "label" type: "uint64" is_used: true }
  slots { name: "user" type: "uint64" is_used: true }
  slots { name: "tags" type: "uint64" is_used: true }
  slots { name: "price" type: "float" is_dense: true is_used: true }
}
"""
HASH = 64
#: Paddle's padding id (-1 as int64): its lookup is zeros, it never gets a row
PADDING = 2**64 - 1
#: ids that hashing to HASH rows would fold together, and the two of the issue
USERS = [2**40 + 9, 2**64 - 5, 9, 9 + HASH, 2**63, 2**63 + HASH, 2**64 - 5 - HASH, 17]
TAGS = [3, 3 + HASH, 2**40 + 9, PADDING, 2**63 + 3]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """2 training files and a test file: one user and 1-3 tags an instance."""
    root = tmp_path_factory.mktemp("sparse")
    (root / "desc.prototxt").write_text(DESC)
    rng = np.random.default_rng(4)
    for folder, files in (("train", 2), ("test", 1)):
        (root / folder).mkdir()
        for f in range(files):
            lines = []
            for _ in range(60):
                user = USERS[rng.integers(len(USERS))]
                tags = [TAGS[k] for k in rng.integers(0, len(TAGS), rng.integers(1, 4))]
                label = int(user in (2**40 + 9, 9) or rng.random() < 0.2)
                lines.append(
                    f"1 {label} 1 {user} {len(tags)} {' '.join(map(str, tags))} "
                    f"1 {rng.normal():.3f}"
                )
            (root / folder / f"part-{f}").write_text("\n".join(lines) + "\n")
    return root


def args(root, name, *overrides):
    return [
        "+experiment=ctr_datafeed",
        f"run_dir={root / name}",
        f"tracking.uri={begun_store(root)}",
        f"datafeed.desc={root / 'desc.prototxt'}",
        f"datafeed.train_files={root / 'train'}",
        f"datafeed.test_files={root / 'test'}",
        "ctr.epochs=1",
        "cluster.timeout_s=300",
        *overrides,
    ]


def counted(root, padding: bool = False) -> dict:
    """``{table: {id: [shows, clicks]}}`` over the training files: a show for each
    occurrence of an id in an instance, the instance's label as its click (the padding
    id left out unless ``padding``)."""
    found = {"emb_user": {}, "emb_tags": {}}
    for path in sorted((root / "train").iterdir()):
        for line in path.read_text().splitlines():
            tokens = [int(t) if "." not in t else t for t in line.split()]
            label, user = tokens[1], tokens[3]
            tags = tokens[5 : 5 + tokens[4]]
            for name, ids in (("emb_user", [user]), ("emb_tags", tags)):
                for i in (i for i in ids if padding or i != PADDING):
                    count = found[name].setdefault(i, [0, 0])
                    count[0] += 1
                    count[1] += label
    return found


def saved_rows(tables) -> dict:
    """``{table: {id: the row's saved fields after the id}}`` of a checkpoint's tables."""
    manifest = read_manifest(tables)
    rows = {}
    for table_id, kind, name, *_ in manifest["layout"]:
        if kind != "MemorySparseTable":
            continue
        rows[name] = {}
        for file in sorted(os.listdir(tables / f"{table_id:03d}")):
            with gzip.open(tables / f"{table_id:03d}" / file, "rt") as f:
                for line in f:
                    values = line.split()
                    rows[name][int(values[0])] = [float(v) for v in values[1:]]
    return rows


@pytest.fixture(scope="module")
def cluster(data):
    """A 2-worker, 2-server run with raw ids and a table rule of PaddleRec's."""
    result = run_kspipe(
        *args(
            data,
            "cluster",
            "mode=pserver",
            "workers=2",
            "servers=2",
            "ctr.table.accessor.embedx_sgd_param.name=SparseAdaGradSGDRule",
            "ctr.table.accessor.embedx_sgd_param.adagrad.learning_rate=0.05",
            "ctr.table.accessor.embedx_sgd_param.adagrad.initial_g2sum=3.0",
            "ctr.table.accessor.ctr_accessor_param.nonclk_coeff=0.25",
        ),
        cwd=data,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return data / "cluster"


def test_raw_ids_keep_their_own_rows_with_real_shows_and_clicks(data, cluster):
    """Every id of the training files has a row of its own on the servers, on server
    id % 2, ids 2**40+9 and 2**64-5 and those that hashing would fold together included;
    each row's show is the id's occurrences and its click the labels of those instances;
    its delta score nonclk_coeff * (show - click) + click.  The one exception is 2**64-1,
    Paddle's padding id (-1): looked up as zeros, never given a row."""
    (checkpoint,) = (cluster / "checkpoints").iterdir()
    rows = saved_rows(checkpoint / "tables")
    expected = counted(data)
    for name, counts in expected.items():
        assert sorted(rows[name]) == sorted(counts), name  # no id more, none less
        for i, (shows, clicks) in counts.items():
            _, _, score, show, click = rows[name][i][:5]
            assert (show, click) == (shows, clicks), (name, i)
            assert score == pytest.approx(0.25 * (shows - clicks) + clicks, rel=1e-5)
    assert {2**40 + 9, 2**64 - 5, 9, 9 + HASH} <= set(rows["emb_user"])
    assert PADDING not in rows["emb_tags"]
    for table_id, kind, *_ in read_manifest(checkpoint / "tables")["layout"]:
        if kind == "MemorySparseTable":
            for server in (0, 1):
                (shard,) = (checkpoint / "tables" / f"{table_id:03d}").glob(f"part-{server:03d}*")
                with gzip.open(shard, "rt") as f:
                    assert all(int(line.split()[0]) % 2 == server for line in f)
    # the rule given reached the servers' tables
    rules = read_manifest(checkpoint / "tables")["rules"]
    assert rules["emb_user"][:2] == ["SparseAdamSGDRule", "SparseAdaGradSGDRule"]


def test_the_exported_model_holds_the_tables_rows_and_scores_as_the_cluster(data, cluster):
    """The inference model holds the rows the servers hold (its size follows the tables,
    not ctr.hash_size), looks raw ids up, gives an unknown id a row of zeros, and scores
    the test file exactly as the cluster's evaluation did."""
    import paddle

    from kspipe.ctr.evaluation import roc_auc
    from kspipe.datafeed import DataFeedDesc, python_batches

    paddle.enable_static()
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        program, feeds, fetch = paddle.static.load_inference_model(
            str(cluster / "inference_model" / "model"), exe
        )
        expected = counted(data)
        for name in expected:
            keys = np.array(scope.find_var(f"{name}.keys").get_tensor()).view(np.uint64)
            table = np.array(scope.find_var(name).get_tensor())
            assert sorted(keys.tolist()) == sorted(expected[name]), name
            assert table.shape == (len(keys) + 1, 8) and not table[-1].any()
        desc = DataFeedDesc(str(data / "desc.prototxt"))
        labels, scores = [], []
        for feed in python_batches(sorted((data / "test").iterdir()), desc, 16, {"price": 1}):
            labels.append(np.array(feed["label"]).ravel())
            (pred,) = exe.run(program, feed={k: feed[k] for k in feeds}, fetch_list=fetch)
            scores.append(pred.ravel())
    metrics = json.loads((cluster / "metrics.json").read_text())
    assert roc_auc(np.concatenate(labels), np.concatenate(scores)) == metrics["test_auc"]


def test_one_process_hashes_raw_ids_and_says_how_many_collide(data):
    """mode=local keeps tables in-process, hashed modulo ctr.hash_size: it says, per
    table, the training ids, the rows they fall in and the share of ids sharing a row."""
    result = run_kspipe(*args(data, "local", f"ctr.hash_size={HASH}"), cwd=data)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, counts in counted(data, padding=True).items():
        ids = np.array(sorted(counts), np.uint64)
        rows, folded = np.unique(ids % np.uint64(HASH), return_counts=True)
        share = folded[folded > 1].sum() / len(ids)
        assert (
            f"table {name}: {len(ids)} distinct ids hashed into {len(rows)} of {HASH} rows; "
            f"{share:.2%} of the ids share a row"
        ) in result.stderr


PADDLEREC = {  # PaddleRec's slot_dnn config_online.yaml: table_parameters.embedding
    "table_class": "MemorySparseTable",
    "shard_num": 10,
    "accessor": {
        "accessor_class": "SparseAccessor",
        "fea_dim": 10,
        "embedx_dim": 7,
        "embedx_threshold": 10,
        "embed_sgd_param": {
            "name": "SparseAdaGradSGDRule",
            "adagrad": {
                "learning_rate": 0.05,
                "initial_g2sum": 1.0e-6,
                "initial_range": 1.0e-4,
                "weight_bounds": [-10.0, 10.0],
            },
        },
        "embedx_sgd_param": {
            "name": "SparseAdaGradSGDRule",
            "adagrad": {
                "learning_rate": 0.05,
                "initial_g2sum": 1.0e-6,
                "initial_range": 1.0e-4,
                "weight_bounds": [-10.0, 10.0],
            },
        },
        "ctr_accessor_param": {
            "nonclk_coeff": 0.1,
            "click_coeff": 1.0,
            "base_threshold": 1.5,
            "delta_threshold": 0.25,
            "delta_keep_days": 16.0,
            "show_click_decay_rate": 0.98,
            "delete_threshold": 0.8,
            "delete_after_unseen_days": 30.0,
            "ssd_unseenday_threshold": 1,
        },
    },
}


def flat(prefix: str, node) -> list:
    if isinstance(node, dict):
        return [o for k, v in node.items() for o in flat(f"{prefix}.{k}", v)]
    return [f"{prefix}={json.dumps(node)}"]


def test_a_paddlerec_table_block_builds_the_same_table():
    """PaddleRec's table_parameters of a table, given as ctr.table, becomes the same
    TableParameter fleet builds the servers' table from."""
    from paddle.distributed.fleet.proto import distributed_strategy_pb2

    from kspipe.ctr.tables import check_tables, server_tables

    cfg = compose_config(["+experiment=ctr_datafeed", *flat("ctr.table", PADDLEREC)])
    check_tables(cfg)
    (ours,) = server_tables(cfg, ["emb_user"]).values()
    made, theirs = (distributed_strategy_pb2.TableParameter() for _ in range(2))
    json_format.ParseDict(ours, made)
    json_format.ParseDict(PADDLEREC, theirs)
    assert made == theirs


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("ctr.table.entry=count_filter:20", "CountFilterEntry and ProbabilityEntry are accepted"),
        ("ctr.table.accessor.accessor_class=CtrCommonAccessor", "cvm op"),
        ("ctr.table.table_class=SSDSparseTable", "hung"),
        ("ctr.table.accessor.embedx_dim=8", "set ctr.embedding_dim=9"),
        ("ctr.table.accessor.fea_dim=8", "fea_dim 10"),
        (
            "ctr.table.accessor.ctr_accessor_param.show_click_decay_rate=0",
            "show_click_decay_rate=0 must be above 0 and at most 1",
        ),
        (
            "ctr.table.accessor.ctr_accessor_param.delete_threshold=-1",
            "delete_threshold=-1 must be at least 0",
        ),
        ("ctr.table.accessor.embed_sgd_param.name=Adam", "must be one of SparseNaiveSGDRule"),
        ("ctr.table.shard_num=0", "shard_num=0 must be at least 1"),
        ("ctr.ids=hash", "ctr.ids='hash' must be raw or hashed"),
        ("+ctr.tables.emb_user.accessor.embedx_threshold=-2", "ctr.tables.emb_user.accessor"),
    ],
)
def test_bad_table_parameters_are_one_line(data, override, fragment):
    result = run_kspipe(*args(data, "bad", "mode=pserver", override), cwd=data)
    assert_one_line_error(result, fragment)


def test_a_days_end_ages_decays_and_evicts_rows_and_logs_what_is_held(data):
    """ctr.shrink: at the day's end (an epoch) every row ages a day, show and click decay
    by show_click_decay_rate, and the rows whose score is then below delete_threshold are
    deleted: the saved tables hold exactly the ids the training files' counts keep, and
    MLflow's table/<name>/rows says how many."""
    import mlflow

    decay, threshold = 0.5, 2.0
    result = run_kspipe(
        *args(
            data,
            "shrunk",
            "mode=pserver",
            "workers=2",
            "servers=2",
            "ctr.shrink=true",
            f"ctr.table.accessor.ctr_accessor_param.show_click_decay_rate={decay}",
            f"ctr.table.accessor.ctr_accessor_param.delete_threshold={threshold}",
        ),
        cwd=data,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (checkpoint,) = (data / "shrunk" / "checkpoints").iterdir()
    rows = saved_rows(checkpoint / "tables")
    client = mlflow.MlflowClient(f"sqlite:///{data / 'mlflow.db'}")
    (run,) = [
        r
        for r in client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
        if r.data.params.get("run_dir") == str(data / "shrunk")
    ]
    split = 0
    for name, counts in counted(data).items():
        kept = {
            i
            for i, (shows, clicks) in counts.items()
            if decay * (0.1 * (shows - clicks) + clicks) >= threshold
        }
        split += len(counts) - len(kept)
        assert set(rows[name]) == kept, name
        for i in kept:
            unseen, show, click = rows[name][i][1], rows[name][i][3], rows[name][i][4]
            assert (unseen, show, click) == (1, decay * counts[i][0], decay * counts[i][1])
        (logged,) = client.get_metric_history(run.info.run_id, f"table/{name}/rows")
        assert (logged.step, logged.value) == (1, len(kept))
    assert split  # some rows were deleted
