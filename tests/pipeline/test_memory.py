"""A kspipe process caps glibc's malloc arenas at its cores (kspipe/process/memory.py): threads that
allocate then share arenas instead of each keeping one's freed memory; and runs Paddle's
executor serially, Reptile's lanes included, freeing dead tensors a megabyte at a time.
The command and a launched worker set these up first thing (kspipe/cli/process.py), and
importing them sets nothing."""

import json
import os
import subprocess
import sys

import pytest

from kspipe.process.memory import FREE_ENV, SERIAL_ENV
from kspipe.testing import run_kspipe, tiny_overrides

#: A process's start, by how it starts: as a ``kspipe`` command (its entry point, with a
#: flag it answers without a job), as a launched worker (given no job file: it says how to
#: run it), or a plain Python process that imports those entry points and calls neither.
STARTS = {
    "plain": "",
    "imported": "import kspipe.__main__, kspipe.cli.__main__, kspipe.cli.command, "
    "kspipe.cli.worker\n",
    "kspipe": "import sys\n"
    "sys.argv = ['kspipe', '--version']\n"
    "from kspipe.__main__ import main\n"
    "try:\n"
    "    main()\n"
    "except SystemExit as done:\n"
    "    assert done.code in (0, None), done.code\n",
    "worker": "from kspipe.cli.worker import main\nassert main([]) == 2  # its usage\n",
}

#: Starts 16 threads that each allocate and wait for the others (a thread gets an arena of
#: its own while glibc's cap allows, and gives it back when it ends), then prints glibc's
#: malloc_info: one <heap> per arena.
ARENAS = """
import ctypes, threading
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


def started(how: str, then: str, env: dict) -> subprocess.CompletedProcess:
    """A Python process started as ``how`` says (:data:`STARTS`) that then runs ``then``."""
    result = subprocess.run(
        [sys.executable, "-c", STARTS[how] + then],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, (how, result.stderr[-2000:])
    return result


def arenas(how: str, env: dict | None = None) -> int:
    return started(how, ARENAS, {**os.environ, **(env or {})}).stdout.count("<heap nr=")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_kspipe_process_has_as_many_arenas_as_cores():
    cores = max(2, len(os.sched_getaffinity(0)))
    plain = arenas("plain")
    assert plain > cores  # the threads would each take one (so the check below can fail)
    assert arenas("imported") > cores  # an import caps nothing
    assert arenas("kspipe") <= cores
    assert arenas("worker") <= cores
    assert arenas("kspipe", {"MALLOC_ARENA_MAX": "5"}) == 5  # the user's own cap is kept


def test_a_kspipe_process_sets_paddles_executor_unless_told_otherwise():
    """Serial, and dead tensors freed a megabyte at a time (Paddle's default hands each to
    its collector's thread as it dies); a user's own values are kept."""
    flags = [SERIAL_ENV, FREE_ENV]
    ask = f"import paddle\nprint(*paddle.get_flags({flags!r}).values())\n"
    for how, given, expected in (
        ("kspipe", {}, "True 0.001"),
        ("worker", {}, "True 0.001"),
        ("kspipe", {SERIAL_ENV: "0", FREE_ENV: "0"}, "False 0.0"),
        ("worker", {SERIAL_ENV: "0", FREE_ENV: "0"}, "False 0.0"),
        ("imported", {}, "False 0.0"),  # an import sets nothing: Paddle's own defaults
        ("plain", {}, "False 0.0"),
    ):
        env = {k: v for k, v in os.environ.items() if k not in flags}
        result = started(how, ask, {**env, **given})
        assert result.stdout.strip().splitlines()[-1] == expected, (how, given, result.stderr)


def test_importing_the_entry_points_leaves_the_environment_as_it_was():
    """The command's modules and the worker's set nothing in the environment when they
    import, only when the process starts through them."""
    show = "import os, sys\nprint(sorted(k for k in os.environ if k not in sys.argv[1:]))\n"
    names = [k for k in os.environ if not k.startswith(("GLOG_", "FLAGS_", "KMP_"))]
    env = {k: os.environ[k] for k in names}
    for how, expected in (
        ("imported", "[]"),
        (
            "worker",
            "['FLAGS_eager_delete_tensor_gb', "
            "'FLAGS_new_executor_serial_run', 'GLOG_minloglevel', "
            "'KMP_BLOCKTIME']",
        ),
    ):
        result = subprocess.run(
            [sys.executable, "-c", STARTS[how] + show, *names],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == expected, (how, result.stderr[-2000:])


@pytest.mark.parametrize(
    "evaluation",
    [
        # two lanes adapt groups of tasks twice (the test tasks, then the training tasks): as
        # lanes took turns on a pool's threads, the serial executor failed in oneDNN
        ["eval.tasks=8", "eval.train_tasks=4", "eval.batch_tasks=2"],
        # the model's executor adapts the meta-batch side by side on the job's thread, then
        # groups of 3 tasks (another program) on a lane's thread: a convolution crashed there
        ["eval.tasks=3", "eval.train_tasks=2", "eval.interval_tasks=2"],
    ],
)
def test_reptiles_lanes_on_the_serial_executor_reach_the_threaded_executors_numbers(
    tmp_path, tiny_data, evaluation
):
    """Reptile's lanes on Paddle's serial executor, evaluating on two threads: the job's
    numbers equal those of Paddle's threaded executor."""
    metrics = {}
    for serial in ("1", "0"):
        folder = tmp_path / serial
        folder.mkdir()
        result = run_kspipe(
            "+experiment=omniglot_5way",
            *tiny_overrides(folder, tiny_data),
            "tracking.enabled=false",
            "eval.interval=0",
            "eval.threads=2",
            "train.meta_batch=2",
            *evaluation,
            cwd=folder,
            env=dict(os.environ, **{SERIAL_ENV: serial}),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        metrics[serial] = json.loads((folder / "run" / "metrics.json").read_text())
    serial, threaded = (
        {k: v for k, v in m.items() if "accuracy" in k or "loss" in k}
        for m in (metrics["1"], metrics["0"])
    )
    assert serial == threaded and len(serial) >= 4, (metrics["1"], metrics["0"])
