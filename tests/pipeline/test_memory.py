"""A kspipe process caps glibc's malloc arenas at its cores (kspipe/memory.py): threads that
allocate then share arenas instead of each keeping one's freed memory; and runs Paddle's
executor serially, Reptile's lanes included, freeing dead tensors a megabyte at a time."""

import json
import os
import subprocess
import sys

import pytest

from kspipe.memory import FREE_ENV, SERIAL_ENV
from kspipe.testing import run_kspipe, tiny_overrides

#: Starts 16 threads that each allocate and wait for the others (a thread gets an arena of
#: its own while glibc's cap allows, and gives it back when it ends), then prints glibc's
#: malloc_info: one <heap> per arena.
ARENAS = """
import ctypes, sys, threading
if sys.argv[1] == "kspipe":
    import kspipe.cli.command  # what a kspipe command imports first
elif sys.argv[1] == "worker":
    import kspipe.cli.worker
together = threading.Barrier(16)
def allocate():
    for _ in range(20):
        ctypes.create_string_buffer(64 * 1024)
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
out = libc.fdopen(1, b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fflush(ctypes.c_void_p(out))
"""


def arenas(how: str, env: dict | None = None) -> int:
    result = subprocess.run([sys.executable, "-c", ARENAS, how], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.count("<heap nr=")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_kspipe_process_has_as_many_arenas_as_cores():
    cores = max(2, len(os.sched_getaffinity(0)))
    plain = arenas("plain")
    assert plain > cores  # the threads would each take one (so the check below can fail)
    assert arenas("kspipe") <= cores
    assert arenas("worker") <= cores
    assert arenas("kspipe", {"MALLOC_ARENA_MAX": "5"}) == 5  # the user's own cap is kept


def test_a_kspipe_process_sets_paddles_executor_unless_told_otherwise():
    """Serial, and dead tensors freed a megabyte at a time (Paddle's default hands each to
    its collector's thread as it dies); a user's own values are kept."""
    flags = [SERIAL_ENV, FREE_ENV]
    ask = "import {}paddle; print(*paddle.get_flags({!r}).values())"
    for module, given, expected in (
            ("kspipe.cli.command, ", {}, "True 0.001"), ("kspipe.cli.worker, ", {}, "True 0.001"),
            ("kspipe.cli.command, ", {SERIAL_ENV: "0", FREE_ENV: "0"}, "False 0.0"),
            ("kspipe.cli.worker, ", {SERIAL_ENV: "0", FREE_ENV: "0"}, "False 0.0"),
            ("", {}, "False 0.0")):  # Paddle's own defaults
        env = {k: v for k, v in os.environ.items() if k not in flags}
        result = subprocess.run([sys.executable, "-c", ask.format(module, flags)],
                                capture_output=True, text=True, env={**env, **given},
                                timeout=120)
        assert result.stdout.strip() == expected, (module, given, result.stderr[-2000:])


@pytest.mark.parametrize("evaluation", [
    # two lanes adapt groups of tasks twice (the test tasks, then the training tasks): as
    # lanes took turns on a pool's threads, the serial executor failed in oneDNN
    ["eval.tasks=8", "eval.train_tasks=4", "eval.batch_tasks=2"],
    # the model's executor adapts the meta-batch side by side on the job's thread, then
    # groups of 3 tasks (another program) on a lane's thread: a convolution crashed there
    ["eval.tasks=3", "eval.train_tasks=2", "eval.interval_tasks=2"]])
def test_reptiles_lanes_on_the_serial_executor_reach_the_threaded_executors_numbers(
        tmp_path, tiny_data, evaluation):
    """Reptile's lanes on Paddle's serial executor, evaluating on two threads: the job's
    numbers equal those of Paddle's threaded executor."""
    metrics = {}
    for serial in ("1", "0"):
        folder = tmp_path / serial
        folder.mkdir()
        result = run_kspipe("+experiment=omniglot_5way", *tiny_overrides(folder, tiny_data),
                            "tracking.enabled=false", "eval.interval=0", "eval.threads=2",
                            "train.meta_batch=2", *evaluation,
                            cwd=folder, env=dict(os.environ, **{SERIAL_ENV: serial}))
        assert result.returncode == 0, result.stderr[-3000:]
        metrics[serial] = json.loads((folder / "run" / "metrics.json").read_text())
    serial, threaded = ({k: v for k, v in m.items() if "accuracy" in k or "loss" in k}
                        for m in (metrics["1"], metrics["0"]))
    assert serial == threaded and len(serial) >= 4, (metrics["1"], metrics["0"])
