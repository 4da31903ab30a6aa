"""Feeding several devices, as the Fluid-era ParallelExecutor and DataFeeder did."""

import numpy as np
import pytest

from kspipe.errors import DataError
from kspipe.openks.feeding import DataFeeder, split_feed


def test_a_dict_feed_is_split_across_devices():
    feed = {"x": np.arange(10).reshape(5, 2), "y": np.arange(5)}
    parts = split_feed(feed, 2)
    assert [len(p["y"]) for p in parts] == [2, 3]
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), feed["x"])


def test_a_list_feed_gives_one_dict_per_device():
    feeds = [{"x": np.zeros(3)}, {"x": np.ones(1)}]
    assert split_feed(feeds, 2)[1]["x"].tolist() == [1.0]
    with pytest.raises(DataError, match="one dict per device: got 2 dicts for 3 devices"):
        split_feed(feeds, 3)


def test_fewer_samples_than_devices_is_an_error():
    with pytest.raises(DataError, match="a batch of 1 samples cannot be split across 2 devices"):
        split_feed({"x": np.zeros((1, 4))}, 2)
    with pytest.raises(DataError, match="different batch sizes"):
        split_feed({"x": np.zeros(3), "y": np.zeros(2)}, 1)


def test_feeder_stacks_samples_with_the_variables_dtypes():
    import paddle

    paddle.enable_static()
    with paddle.static.program_guard(paddle.static.Program()):
        x = paddle.static.data("x", [None, 2], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
    feeder = DataFeeder([x, y], num_devices=2)
    out = feeder.feed([([1, 2], [0]), ([3, 4], [1])])
    assert out["x"].dtype == np.float32 and out["y"].dtype == np.int64
    assert out["x"].shape == (2, 2)
    parallel = feeder.feed_parallel([[([1, 2], [0])], [([3, 4], [1])]])
    assert [p["x"].tolist() for p in parallel] == [[[1.0, 2.0]], [[3.0, 4.0]]]
    with pytest.raises(DataError, match="one mini-batch per device: got 1 for 2"):
        feeder.feed_parallel([[([1, 2], [0])]])


def test_decorate_reader_groups_batches_and_drops_the_short_last():
    feeder = DataFeeder(["x"], num_devices=2)

    def reader():
        for i in range(5):
            yield [(np.full(2, i),)]

    groups = list(feeder.decorate_reader(reader, multi_devices=True, drop_last=True)())
    assert len(groups) == 2 and [g["x"][0, 0] for g in groups[1]] == [2, 3]
    with pytest.raises(DataError, match="the last 1 mini-batch"):
        list(feeder.decorate_reader(reader, multi_devices=True, drop_last=False)())
    single = list(feeder.decorate_reader(reader, multi_devices=False)())
    assert len(single) == 5
