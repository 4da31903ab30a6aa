"""Real click logs through ``kspipe datafeed convert`` (issue 48, point 8): PaddleRec's
slot format and Criteo's raw TSV become the MultiSlot lines computed here by hand; a line
that does not parse is one line naming its file and line number."""

import hashlib

import pytest

from kspipe.datafeed import DataFeedDesc, parse_line
from kspipe.datafeed.cli import main


def hashed(slot: str, value: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(f"{slot}\x1f{value}".encode(), digest_size=8).digest(), "little"
    )


def criteo_line(label, ints, cats) -> str:
    return "\t".join([str(label), *ints, *cats])


def test_criteo_tsv_becomes_multislot_with_stable_ids_and_missing_values_their_own(tmp_path):
    ints = ["1", "", "5", "0", "1382", "4", "15", "2", "181", "1", "2", "", "2"]
    cats = ["68fd1e64", "80e26c9b", "", "FB936136"] + ["7b4723c4"] * 22
    (tmp_path / "day_0").write_text(
        criteo_line(0, ints, cats) + "\n" + criteo_line(1, ints, [""] * 26) + "\n"
    )
    desc_path = tmp_path / "criteo.prototxt"
    assert (
        main(
            [
                "convert",
                str(tmp_path / "day_0"),
                "--desc",
                str(desc_path),
                "--output",
                str(tmp_path / "out"),
                "--format",
                "criteo",
            ]
        )
        == 0
    )
    desc = DataFeedDesc(str(desc_path))
    assert [s.name for s in desc.slots] == ["label", "dense"] + [f"C{k}" for k in range(1, 27)]
    first, second = (tmp_path / "out" / "part-00000").read_text().splitlines()
    values = parse_line(first, desc.slots, {"dense": 13})
    assert values[0] == [0]
    assert values[1] == [float(v) if v else 0.0 for v in ints]
    assert values[2] == [hashed("C1", "68fd1e64")]
    assert values[4] == [hashed("C3", "")]  # missing: its own id, per slot
    assert values[5] == [hashed("C4", "fb936136")]  # hexadecimal, case folded
    again = parse_line(second, desc.slots, {"dense": 13})
    assert again[0] == [1] and again[4] == values[4] and again[3] != again[4]
    assert hashed("C3", "") >= 0 and any(v[0] >= 2**63 for v in values[2:] + again[2:])


SLOT_DESC = """name: "MultiSlotDataFeed"
batch_size: 2
multi_slot_desc {
  slots { name: "label" type: "uint64" is_used: true }
  slots { name: "2" type: "uint64" is_used: true }
  slots { name: "3" type: "uint64" is_used: true }
  slots { name: "dense_feature" type: "float" is_used: true }
}
"""


def test_paddlerecs_slot_format_becomes_multislot(tmp_path):
    """``feasign:slot`` tokens, the label as the feasign of slot 1, PaddleRec's
    ``dense_feature:0.05`` floats; a slot a line does not name is the id 0."""
    (tmp_path / "desc.prototxt").write_text(SLOT_DESC)
    (tmp_path / "log").write_text(
        "1:1 dense_feature:0.05 dense_feature:0.5 18446744073709551610:2 77:2 5:3 9:99\n"
        "0:1 dense_feature:1 4:2\n"
    )
    assert (
        main(
            [
                "convert",
                str(tmp_path / "log"),
                "--desc",
                str(tmp_path / "desc.prototxt"),
                "--output",
                str(tmp_path / "out"),
                "--format",
                "slot",
                "--label-slot",
                "1",
            ]
        )
        == 0
    )
    assert (tmp_path / "out" / "part-00000").read_text().splitlines() == [
        "1 1 2 18446744073709551610 77 1 5 2 0.05 0.5",
        "1 0 1 4 1 0 1 1",
    ]


@pytest.mark.parametrize(
    "fmt, line, fragment",
    [
        ("criteo", "1\t2\t3", "3 tab-separated fields; a Criteo line has 40"),
        ("criteo", criteo_line(1, ["x"] + [""] * 12, [""] * 26), "count I1 is 'x'"),
        ("criteo", criteo_line(1, [""] * 13, ["zz"] + [""] * 25), "categorical C1 is 'zz'"),
        ("criteo", criteo_line(2, [""] * 13, [""] * 26), "the label is '2'"),
        ("slot", "1:1 abc:2", "slot 2 holds 'abc'"),
        ("slot", "4:2 5:3", "no label (slot 1)"),
        ("slot", "1:1 4", "token '4' is not value:slot"),
    ],
)
def test_a_line_that_does_not_parse_is_one_line_naming_file_and_line(
    tmp_path, capsys, fmt, line, fragment
):
    (tmp_path / "desc.prototxt").write_text(SLOT_DESC)
    good = criteo_line(0, [""] * 13, [""] * 26) if fmt == "criteo" else "0:1 dense_feature:1 4:2"
    (tmp_path / "log").write_text(f"{good}\n{good}\n{line}\n")
    desc = tmp_path / ("criteo.prototxt" if fmt == "criteo" else "desc.prototxt")
    code = main(
        [
            "convert",
            str(tmp_path / "log"),
            "--desc",
            str(desc),
            "--output",
            str(tmp_path / "out"),
            "--format",
            fmt,
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert f"{tmp_path / 'log'}:3: {fragment}" in err[0]
    assert not list((tmp_path / "out").glob("part-*"))  # nothing half converted is left


def test_criteo_files_train_directly(tmp_path):
    """datafeed.format=criteo: the raw TSV files train with no convert step (each worker
    converts its own into the run folder); a bad line names the original file and line."""
    import json

    import numpy as np

    from kspipe.testing import assert_one_line_error, begun_store, run_kspipe

    rng = np.random.default_rng(0)
    for folder, files in (("train", 2), ("test", 1)):
        (tmp_path / folder).mkdir()
        for f in range(files):
            lines = []
            for _ in range(100):
                cats = [
                    f"{rng.integers(0, 40):08x}" if rng.random() < 0.9 else "" for _ in range(26)
                ]
                ints = [str(rng.integers(0, 9)) if rng.random() < 0.8 else "" for _ in range(13)]
                lines.append(criteo_line(int(cats[0] < "00000014"), ints, cats))
            (tmp_path / folder / f"day-{f}").write_text("\n".join(lines) + "\n")
    args = [
        "+experiment=ctr_datafeed",
        f"tracking.uri={begun_store(tmp_path)}",
        "datafeed.format=criteo",
        f"datafeed.train_files={tmp_path / 'train'}",
        f"datafeed.test_files={tmp_path / 'test'}",
        "datafeed.batch_size=32",
        "ctr.epochs=1",
    ]
    result = run_kspipe(*args, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train_instances"] == 200 and metrics["test_instances"] == 100
    bad = tmp_path / "train" / "day-1"
    bad.write_text(bad.read_text() + "1\tnot criteo\n")
    result = run_kspipe(*args, f"run_dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert_one_line_error(result, f"{bad}:101: 2 tab-separated fields")
