"""MultiSlot files and their DataFeedDesc: the seed's API, the checks that name a bad
file and line, variable-length (LoD) slots, the converter and the generated set."""

import json

import numpy as np
import pytest

from kspipe.datafeed import (
    DataFeedDesc,
    convert,
    parse_line,
    python_batches,
    resolve_files,
    scan_files,
)
from kspipe.datafeed import generated as ctr_data
from kspipe.datafeed.cli import main as datafeed_cmd
from kspipe.errors import ConfigError, DataError

SEED_DESC = """name: "MultiSlotDataFeed"
batch_size: 2
multi_slot_desc {
    slots {
        name: "words"
        type: "uint64"
        is_dense: false
        is_used: true
    }
    slots {
        name: "label"
        type: "uint64"
        is_dense: false
        is_used: true
    }
}
"""

THREE_SLOTS = """name: "MultiSlotDataFeed"
batch_size: 4
multi_slot_desc {
  slots { name: "label" type: "uint64" is_used: true }
  slots { name: "ids" type: "uint64" is_used: true }
  slots { name: "price" type: "float" is_dense: true is_used: true }
}
"""


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.fixture
def three(tmp_path):
    return DataFeedDesc(write(tmp_path / "d.prototxt", THREE_SLOTS))


def test_the_seed_api(tmp_path):
    desc = DataFeedDesc(write(tmp_path / "data.proto", SEED_DESC))
    assert desc.batch_size == 2
    assert [s.name for s in desc.slots] == ["words", "label"]
    desc.set_batch_size(128)
    desc.set_dense_slots(["words"])
    desc.set_use_slots("words")
    text = desc.desc()
    assert "batch_size: 128" in text
    reread = DataFeedDesc(write(tmp_path / "again.proto", text))
    assert reread.batch_size == 128 and reread.slot("words").is_dense
    assert not reread.slot("label").is_dense  # by default no slot is dense


def test_slots_are_unused_until_marked(tmp_path):
    desc = DataFeedDesc(write(tmp_path / "d", SEED_DESC.replace("is_used: true", "is_used: false")))
    assert desc.used_slots == []
    desc.set_use_slots(["label"])
    assert [s.name for s in desc.used_slots] == ["label"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda d: d.set_dense_slots(["wd"]), "no slot named 'wd'"),
        (lambda d: d.set_use_slots(["wd", "x"]), "no slot named 'wd', 'x'"),
        (lambda d: d.set_batch_size(0), "batch_size=0 must be at least 1"),
    ],
)
def test_bad_desc_calls(tmp_path, call, message):
    desc = DataFeedDesc(write(tmp_path / "d", SEED_DESC))
    with pytest.raises(ConfigError, match=message):
        call(desc)


@pytest.mark.parametrize(
    "text, message",
    [
        (SEED_DESC.replace("batch_size: 2", "batch_size: two"), r"d\.proto:2:"),
        (SEED_DESC.replace('"uint64"', '"int8"', 1), "has type 'int8'"),
        (SEED_DESC.replace('name: "label"', 'name: "words"'), "slot 'words' appears twice"),
        ('name: "MultiSlotDataFeed"\nbatch_size: 2\n', "has no slots"),
        (SEED_DESC.replace("MultiSlotDataFeed", "SlotRecordInMemoryDataFeed"), "kspipe reads"),
    ],
)
def test_bad_desc_files(tmp_path, text, message):
    with pytest.raises(DataError, match=message):
        DataFeedDesc(write(tmp_path / "d.proto", text))


def test_missing_desc_file(tmp_path):
    with pytest.raises(DataError, match="nothing.proto"):
        DataFeedDesc(str(tmp_path / "nothing.proto"))


def test_a_line_parses_into_its_slots(three):
    values = parse_line("1 1 3 7 18446744073709551615 9 1 2.5", three.slots, {})
    assert values == [[1], [7, 2**64 - 1, 9], [2.5]]


@pytest.mark.parametrize(
    "line, message",
    [
        ("1 1 3 7 8", "f:5: slot 'ids' says 3 values but the line has only 2 left"),
        ("1 1 3 7 8 1 2.5", "f:5: the value count of slot 'price' is '2.5'"),
        ("1 1 2 7 x 1 2.5", "f:5: slot 'ids' is uint64 but holds 'x'"),
        ("1 1 2 7 0.5 1 2.5", "f:5: slot 'ids' is uint64 but holds '0.5'"),
        ("1 1 1 7 1 cheap", "f:5: slot 'price' is float but holds 'cheap'"),
        ("1 1 0 1 2.5", "f:5: slot 'ids' has 0 values"),
        ("1 1 1 7", "f:5: the line ends before slot 'price'"),
        ("1 1 1 7 1 2.5 3", "f:5: 1 values left after the last slot 'price'"),
        ("1 1 1 7 2 2.5 3.5", "f:5: dense slot 'price' has 2 values, expected 1"),
        ("1 1 1 -3 1 2.5", "f:5: slot 'ids' holds -3, outside uint64"),
        ("one 1 1 7 1 2.5", "f:5: the value count of slot 'label' is 'one'"),
    ],
)
def test_malformed_lines_are_named(three, line, message):
    with pytest.raises(DataError) as err:
        parse_line(line, three.slots, {"price": 1}, "f", 5)
    assert message in str(err.value)


def test_scan_names_the_file_and_line(tmp_path, three):
    good = write(tmp_path / "good", "1 0 2 5 6 1 1.0\n1 1 1 5 1 2.0\n")
    bad = write(tmp_path / "bad", "1 0 2 5 6 1 1.0\n\n1 1 1 5 1 2.0\n1 1 1 oops 1 2.0\n")
    counts = scan_files([good], three)
    assert counts.lines == {good: 2} and counts.dense_width == {"price": 1}
    with pytest.raises(DataError, match=f"{bad}:4: slot 'ids' is uint64 but holds 'oops'"):
        scan_files([good, bad], three)
    assert scan_files([bad], three, check=False).total == 4  # counting only


def test_file_lists(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("b", "a", ".hidden"):
        (tmp_path / "d" / name).write_text("1 1\n")
    assert [p.split("/")[-1] for p in resolve_files(str(tmp_path / "d"), "k")] == ["a", "b"]
    assert len(resolve_files(str(tmp_path / "d" / "*"), "k")) == 2
    (tmp_path / "empty").mkdir()
    for spec, message in (
        (str(tmp_path / "empty"), "folder .* has no files"),
        ([], "the file list is empty"),
        (str(tmp_path / "nope"), "no such file"),
        (str(tmp_path / "x*"), "no file matches"),
        (None, "k is not set"),
    ):
        with pytest.raises((DataError, ConfigError), match=message):
            resolve_files(spec, "k")


def test_variable_length_slots_become_lod_tensors(tmp_path, three):
    import paddle

    path = write(
        tmp_path / "f",
        "1 0 1 4 1 0.5\n1 1 3 1 2 3 1 1.5\n1 0 2 9 9 1 2.5\n1 1 1 18446744073709551615 1 3.5\n",
    )
    batches = list(python_batches([path], three, 3, {}))
    assert [b["price"].shape for b in batches] == [(3, 1), (1, 1)]
    ids = batches[0]["ids"]
    assert ids.recursive_sequence_lengths() == [[1, 3, 2]]
    assert np.array(ids).ravel().tolist() == [4, 1, 2, 3, 9, 9]
    assert np.array(batches[1]["ids"]).ravel().tolist() == [-1]  # uint64 wraps as in Paddle
    # a LoD-aware op sees one sequence per instance
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("ids", [-1, 1], "int64", lod_level=1)
        pooled = paddle.static.nn.sequence_pool(paddle.cast(x, "float32"), "sum")
    exe = paddle.static.Executor(paddle.CPUPlace())
    (sums,) = exe.run(main, feed={"ids": ids}, fetch_list=[pooled])
    assert sums.ravel().tolist() == [4, 6, 18]


def test_convert_csv_and_json_lines(tmp_path, three):
    csv_path = write(tmp_path / "r.csv", "label,ids,price\n1,7 alice,2.5\n0,,3\n")
    out = convert(csv_path, three, str(tmp_path / "csv"), lines_per_file=1)
    assert len(out) == 2
    first = open(out[0]).read().split()
    assert first[:4] == ["1", "1", "2", "7"] and first[5:] == ["1", "2.5"]
    # "alice" hashed to the same uint64 in every process (Python's hash() of a str is not)
    assert int(first[4]) == 9933345172075899469
    assert open(out[1]).read().split()[2:4] == ["1", "0"]  # an empty sparse slot is padded
    jsonl = write(
        tmp_path / "r.jsonl",
        json.dumps({"label": 1, "ids": [7, "alice"], "price": 2.5})
        + "\n"
        + json.dumps({"label": 0, "ids": 3, "price": [1.0]})
        + "\n",
    )
    (j,) = convert(jsonl, three, str(tmp_path / "json"))
    assert open(j).read().splitlines()[0] == open(out[0]).read().strip()
    assert scan_files([j], three).total == 2


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "r.csv",
            "label,ids,price\n1,7,cheap\n",
            "r.csv:2: slot 'price' is float but holds 'cheap'",
        ),
        ("r.csv", "label,ids,price\n1,7,\n", "r.csv:2: no value for float slot 'price'"),
        ("r.jsonl", '{"label": 1, "ids": [1], "price": 2}\n{"label": 1,\n', "r.jsonl:2: not JSON"),
        ("r.jsonl", '{"label": 1, "ids": [0.5], "price": 2}\n', "r.jsonl:1: slot 'ids' is uint64"),
        ("r.jsonl", "[1, 2]\n", "r.jsonl:1: a JSON line must be an object"),
        ("r.csv", "label,ids,price\n", "has no records"),
    ],
)
def test_convert_bad_records(tmp_path, three, name, text, message):
    with pytest.raises(DataError, match=message):
        convert(write(tmp_path / name, text), three, str(tmp_path / "out"))
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == []  # nothing half-written is left


def test_generated_set_is_deterministic_and_well_formed(tmp_path):
    a = ctr_data.generate(str(tmp_path / "a"), 2, 1, 300, seed=3)
    b = ctr_data.generate(str(tmp_path / "b"), 2, 1, 300, seed=3)
    c = ctr_data.generate(str(tmp_path / "c"), 2, 1, 300, seed=4)
    for name in ("train/part-00000", "train/part-00001", "test/part-00000"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a/train/part-00000").read_bytes() != (
        tmp_path / "c/train/part-00000"
    ).read_bytes()
    desc = DataFeedDesc(f"{a}/{ctr_data.DESC_NAME}")
    counts = scan_files(resolve_files(f"{a}/train", "t"), desc)
    assert counts.total == 600 and counts.dense_width == {"dense": ctr_data.DENSE_WIDTH}
    values = [parse_line(line, desc.slots, {}) for line in open(f"{a}/train/part-00000")]
    labels = [v[0][0] for v in values]
    assert set(labels) == {0, 1}
    assert max(i for v in values for i in v[2]) >= 2**63  # ids over the whole uint64 range
    assert len({len(v[4]) for v in values}) > 1  # tags vary in length
    del b, c


def test_datafeed_command(tmp_path, capsys):
    assert (
        datafeed_cmd(
            [
                "generate",
                str(tmp_path / "g"),
                "--train-files",
                "1",
                "--test-files",
                "1",
                "--lines-per-file",
                "20",
            ]
        )
        == 0
    )
    desc = str(tmp_path / "g" / ctr_data.DESC_NAME)
    assert datafeed_cmd(["check", "--desc", desc, str(tmp_path / "g" / "train")]) == 0
    assert "20 instances: all well formed" in capsys.readouterr().out
    bad = write(tmp_path / "bad", "1 0 4 0 0 0 0 1 5 1 6\n")
    assert datafeed_cmd(["check", "--desc", desc, bad]) == 2
    assert f"kspipe: error: {bad}:1: the line ends before slot 'tags'" in capsys.readouterr().err
    assert datafeed_cmd(["generate", str(tmp_path / "h"), "--lines-per-file", "0"]) == 2
