"""Checkpoints by wall-clock time (``train.checkpoint_minutes``) and checkpoints written on a
thread of their own: when they fall (one process, and workers that must agree), that they
resume as step checkpoints do, and that a write under way is complete when the process ends."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kspipe import checkpoint
from kspipe.checkpoint.schedule import Schedule
from kspipe.errors import ConfigError
from kspipe.pipeline import run
from kspipe.testing import compose_config, plugin_manager
from tests.kit.workers import Workers


def clock(times):
    ticks = iter(times)
    return lambda: next(ticks)


def test_one_process_checkpoints_every_so_many_steps_and_seconds():
    # every 3 steps and every second; steps end at these times (the first reading: the start)
    schedule = Schedule(3, 1 / 60, 0, clock=clock([0, 0.4, 0.8, 1.2, 1.5, 2.0, 2.3, 2.6, 3.5]))
    assert [step for step in range(1, 9) if schedule.due(step)] == [3, 6, 8]
    by_steps = Schedule(3, None, 1)  # no clock read without minutes
    assert [step for step in range(2, 10) if by_steps.due(step)] == [3, 6, 9]


def test_workers_whose_clocks_differ_checkpoint_after_the_same_steps():
    """Worker 0's first step takes 0.5 s (warm-up), then 0.2 s a step; worker 1 starts 10 ms
    later and takes 0.25 s a step.  A second a window: the first window is planned at the
    slower first step's pace (0.5 s: step 2), each next one at the slowest worker's pace
    over the window before (0.35 s: 3 steps; 0.25 s: 4, then 4)."""
    workers = Workers(2)
    clocks = [[0] + [0.3 + 0.2 * k for k in range(1, 15)], [0.01 + 0.25 * k for k in range(15)]]
    due = [None, None]

    def train(index):
        schedule = Schedule(0, 1 / 60, 0, workers.role(index), clock(clocks[index]))
        due[index] = [step for step in range(1, 15) if schedule.due(step)]

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert due == [[2, 5, 9, 13], [2, 5, 9, 13]]


def saved(run_dir: Path, step: int) -> dict:
    folder = run_dir / "checkpoints" / f"checkpoint-{step:07d}"
    arrays = {}
    for suffix in (".pdparams", ".pdopt"):
        arrays.update(checkpoint.read_arrays(str(folder / f"state{suffix}"), "test"))
    return arrays


def steps(run_dir: Path, under: str = "checkpoints") -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / under).glob("checkpoint-*"))


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_checkpoints_by_time_resume_as_checkpoints_by_steps(tiny_cfg, tmp_path):
    common = ("train.meta_iters=4", "train.keep_checkpoints=10", "eval.baseline=false")
    timed, stepped = tmp_path / "timed", tmp_path / "stepped"
    # 60 microseconds: every meta-iteration takes longer, so each one ends a window
    minutes = "train.checkpoint_minutes=0.000001"
    run(
        tiny_cfg(*common, "train.checkpoint_every=0", minutes, f"run_dir={timed}"), plugin_manager()
    )
    run(tiny_cfg(*common, "train.checkpoint_every=2", f"run_dir={stepped}"), plugin_manager())
    assert steps(timed) == [1, 2, 3, 4] and steps(stepped) == [2, 4]
    assert_same(saved(timed, 2), saved(stepped, 2))

    finals = {}
    for name, source in (("from-timed", timed), ("from-stepped", stepped)):
        resumed = tmp_path / name
        point = source / "checkpoints" / "checkpoint-0000002"
        cfg = tiny_cfg(*common, "train.checkpoint_every=0", f"resume={point}", f"run_dir={resumed}")
        run(cfg, plugin_manager())
        finals[name] = saved(resumed, 4)
    assert_same(finals["from-timed"], finals["from-stepped"])
    assert_same(finals["from-timed"], saved(timed, 4))
    assert_same(saved(timed, 4), saved(stepped, 4))


ENDING = """
import os, signal, sys, time
import numpy as np
import paddle
from omegaconf import OmegaConf
from kspipe import checkpoint
from kspipe.process import stopping

folder, ending = sys.argv[1], sys.argv[2]
stopping.install()
paddle.enable_static()
main, startup = paddle.static.Program(), paddle.static.Program()
with paddle.static.program_guard(main, startup):
    x = paddle.static.data("x", [None, 64], "float32")
    loss = paddle.mean(paddle.static.nn.fc(x, 512))
    paddle.optimizer.Adam(0.01).minimize(loss)
scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
exe.run(startup, scope=scope)
feed = {"x": np.ones((4, 64), "float32")}
exe.run(main, feed=feed, scope=scope)
cfg = OmegaConf.create({"seed": 1})
checkpoint.save(main, scope, folder + "/reference/checkpoints", 1, {"step": 1}, 1, cfg)

write = checkpoint.write_copied
def slowly(state, prefix):  # the process ends while this write is under way
    time.sleep(1)
    write(state, prefix)
checkpoint.write_copied = slowly

writer = checkpoint.Writer()
checkpoint.save(main, scope, folder + "/aside/checkpoints", 1, {"step": 1}, 1, cfg, writer=writer)
print("busy" if writer.busy() else "done", flush=True)
exe.run(main, feed=feed, scope=scope)  # training goes on: the copy is the checkpoint
try:
    if ending == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
except stopping.Preempted as stop:
    stopping.exit_stopped(stop)
"""


@pytest.mark.parametrize("ending", ["exit", "sigterm"])
def test_a_checkpoint_written_aside_is_complete_when_the_process_ends_right_after(tmp_path, ending):
    result = subprocess.run(
        [sys.executable, "-c", ENDING, str(tmp_path), ending],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == (143 if ending == "sigterm" else 0), result.stderr[-3000:]
    assert result.stdout.split() == ["busy"]
    assert [p.name for p in (tmp_path / "aside/checkpoints").iterdir()] == ["checkpoint-0000001"]
    assert_same(saved(tmp_path / "aside", 1), saved(tmp_path / "reference", 1))
    assert json.loads(
        (tmp_path / "aside/checkpoints/checkpoint-0000001/progress.json").read_text()
    ) == {"step": 1}


def test_a_write_that_fails_aside_is_raised_in_training_in_one_line(tmp_path, monkeypatch):
    import errno

    from tests.pipeline.test_checkpoint import small_learner

    learner = small_learner(tmp_path)

    def full(state, prefix):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_copied", full)
    folder = tmp_path / "run" / "checkpoints"
    learner.save_checkpoint(str(folder), 1)
    with pytest.raises(Exception) as raised:
        learner.writer.wait()
    assert str(raised.value) == (
        f"a checkpoint could not be written: No space left on device "
        f"(writing {folder}/checkpoint-0000001)"
    )
    assert not folder.exists() or not list(folder.iterdir())  # nothing half-written


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "train.checkpoint_minutes=-1.0 must be more than 0"),
        ("0", "train.checkpoint_minutes=0.0 must be more than 0"),
        ("abc", "train.checkpoint_minutes=abc: must be a number"),
    ],
)
def test_a_bad_checkpoint_minutes_is_one_line(value, message):
    from kspipe.reptile.plugin import kspipe_check_config

    with pytest.raises(ConfigError) as refused:
        kspipe_check_config(compose_config([f"train.checkpoint_minutes={value}"]))
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_ctr_checks_checkpoint_minutes_too():
    from kspipe.ctr.plugin import kspipe_check_config

    cfg = compose_config(["+experiment=ctr_datafeed", "train.checkpoint_minutes=-1"])
    with pytest.raises(ConfigError, match=r"^train.checkpoint_minutes=-1.0 must be more than 0$"):
        kspipe_check_config(cfg)
