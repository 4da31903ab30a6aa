"""The OpenKS API: a seed-style script runs unchanged in one process, on a loopback
parameter-server cluster and collectively on CPU, and learns; every public name of the
seed's API exists with its documented signature.  Checked through the public names only:
the seed's underscore methods (``_transpile``, ``_try_to_compile`` ...) are checked by what
the public ones that call them give (the collective ops and compiled program of
``minimize``)."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kspipe import openks

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "openks_quickstart.py"


def accuracies(text):
    return [float(a) for a in re.findall(r"accuracy (\d\.\d+)", text)]


def test_script_runs_in_one_process(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert accuracies(result.stdout) and accuracies(result.stdout)[0] >= 0.9
    assert (tmp_path / "model" / "model.pdmodel").is_file()


@pytest.mark.parametrize(
    "mode, args",
    [
        ("cpu", ["--strategy", "async"]),
        ("cpu", ["--strategy", "sync"]),
        ("cpu", ["--strategy", "geo"]),
        ("gpu", ["--flag", "1", "--strategy", "allreduce"]),
        ("gpu", ["--flag", "1", "--strategy", "local_sgd"]),
    ],
)
def test_script_runs_on_a_local_cluster(tmp_path, mode, args):
    logs = tmp_path / "logs"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.openks.launch",
            "--mode",
            mode,
            "--worker_num",
            "2",
            "--server_num",
            "1",
            "--log_dir",
            str(logs),
            "--timeout",
            "240",
            str(SCRIPT),
            *args,
            "--out",
            str(tmp_path / "model"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = [accuracies((logs / f"worker.{i}.log").read_text()) for i in range(2)]
    assert all(f and f[0] >= 0.9 for f in found), found
    # the workers trained one model: after barrier_workers each holds it
    assert found[0][0] == found[1][0], found
    assert (tmp_path / "model" / "model.pdmodel").is_file()
    if mode == "cpu":
        assert (logs / "server.0.log").is_file()


#: A script that trains a small model (``--save DIR``: then saves it) or starts from a saved
#: one (``--init DIR``: its servers call ``init_server(DIR)``), and records per worker the
#: parameters and the loss on a fixed batch it started from, and those it saved.
INCREMENTAL = """
import argparse, pickle
import numpy as np
import paddle
from kspipe.openks import (AsyncStrategy, GeoStrategy, KSDistributedFactory,
                           PaddleCloudRoleMaker, SyncStrategy)

STRATEGIES = {"async": AsyncStrategy(), "sync": SyncStrategy(), "geo": GeoStrategy(k_steps=3)}
parser = argparse.ArgumentParser()
for name in ("--strategy", "--save", "--init", "--out"):
    parser.add_argument(name)
args = parser.parse_args()

def batch(rng, n):
    x = rng.normal(size=(n, 8)).astype("float32")
    return {"x": x, "y": (x @ np.arange(-4.0, 4.0) > 0).astype("int64").reshape(-1, 1)}

paddle.enable_static()
paddle.seed(1)
x = paddle.static.data("x", [None, 8], "float32")
y = paddle.static.data("y", [None, 1], "int64")
logits = paddle.static.nn.fc(paddle.static.nn.fc(x, 16, activation="relu"), 2)
loss = paddle.nn.functional.cross_entropy(logits, y)
main = paddle.static.default_main_program()
test_program = main.clone(for_test=True)
algorithm = KSDistributedFactory.instantiation(flag=0)
algorithm.init(PaddleCloudRoleMaker())
algorithm.distributed_optimizer(paddle.optimizer.SGD(0.1), STRATEGIES[args.strategy]).minimize(loss)
if algorithm.is_server():
    algorithm.init_server(args.init) if args.init else algorithm.init_server()
    algorithm.run_server()
    raise SystemExit
exe = paddle.static.Executor(paddle.CPUPlace())
exe.run(paddle.static.default_startup_program())
algorithm.init_worker()
scope, test = paddle.static.global_scope(), batch(np.random.default_rng(7), 64)

def now():
    return ({p.name: np.array(scope.find_var(p.name).get_tensor()) for p in main.all_parameters()},
            float(exe.run(test_program, feed=test, fetch_list=[loss])[0]))

record = {"start": now()}
rng = np.random.default_rng(100 + algorithm.worker_index())
for _ in range(10):
    exe.run(main, feed=batch(rng, 16), fetch_list=[loss])
algorithm.barrier_workers()
if args.save and algorithm.is_first_worker():
    algorithm.save_persistables(exe, args.save)
    record["saved"] = now()
with open(f"{args.out}/worker-{algorithm.worker_index()}.pkl", "wb") as f:
    pickle.dump(record, f)
algorithm.stop_worker()
"""


def launch_cpu(tmp_path, script, name, *args):
    """Run ``script`` on 1 server and 2 workers; return each worker's record."""
    import pickle

    out = tmp_path / name
    out.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.openks.launch",
            "--mode",
            "cpu",
            "--worker_num",
            "2",
            "--server_num",
            "1",
            "--log_dir",
            str(out / "logs"),
            "--timeout",
            "120",
            str(script),
            *args,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [pickle.loads((out / f"worker-{i}.pkl").read_bytes()) for i in range(2)]


@pytest.mark.parametrize("strategy", ["sync", "async", "geo"])
def test_servers_started_from_a_saved_model_continue_from_it(tmp_path, strategy):
    """Incremental training: a job saves its model with save_persistables; a new job whose
    servers call init_server(dir) starts, on every worker, from exactly that model."""
    import pickle

    script = tmp_path / "incremental.py"
    script.write_text(INCREMENTAL)
    model = tmp_path / "model"
    first = launch_cpu(tmp_path, script, "first", "--strategy", strategy, "--save", str(model))
    saved_params, saved_loss = first[0]["saved"]
    assert first[0]["start"][1] != saved_loss  # it trained
    on_disk = pickle.loads((model / "persistables.pdparams").read_bytes())
    assert sorted(on_disk) == sorted(saved_params)
    assert all(np.array_equal(on_disk[name], saved_params[name]) for name in on_disk)

    again = launch_cpu(tmp_path, script, "again", "--strategy", strategy, "--init", str(model))
    for worker in again:
        params, loss = worker["start"]
        assert loss == saved_loss
        assert all(np.array_equal(params[name], on_disk[name]) for name in on_disk)


def test_init_server_reads_a_kspipe_run_in_the_same_format(tmp_path):
    """A checkpoint holds what save_persistables writes (paddle.static.save's files), so
    init_server(dir) takes a kspipe run folder too: its newest checkpoint."""
    import json
    import pickle
    import shutil

    script = tmp_path / "incremental.py"
    script.write_text(INCREMENTAL)
    model = tmp_path / "model"
    first = launch_cpu(tmp_path, script, "first", "--strategy", "sync", "--save", str(model))
    saved = tmp_path / "run" / "checkpoints" / "checkpoint-0000001"
    saved.mkdir(parents=True)
    for suffix in ("pdparams", "pdopt", "pdmodel"):
        shutil.copy(model / f"persistables.{suffix}", saved / f"state.{suffix}")
    (saved / "progress.json").write_text(json.dumps({"step": 1}))
    again = launch_cpu(
        tmp_path, script, "again", "--strategy", "sync", "--init", str(tmp_path / "run")
    )
    on_disk = pickle.loads((model / "persistables.pdparams").read_bytes())
    for worker in again:
        params, loss = worker["start"]
        assert loss == first[0]["saved"][1]
        assert all(np.array_equal(params[name], on_disk[name]) for name in on_disk)


def test_init_server_with_a_model_needs_the_shared_gloo_world(monkeypatch):
    """Handing a saved model to the workers takes the gloo world the servers and workers
    share; a job started without it (not by ``kspipe-launch --mode cpu``) is one line."""
    import paddle

    from kspipe.errors import ConfigError
    from kspipe.openks import algorithms

    monkeypatch.delenv("PADDLE_WITH_GLOO", raising=False)
    monkeypatch.delenv("TRAINING_ROLE", raising=False)  # this process, not a launched one
    paddle.enable_static()
    algorithm = openks.KSDistributedFactory.instantiation(0)
    algorithm.init(openks.PaddleCloudRoleMaker())
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        x = paddle.static.data("x", [None, 4], "float32")
        loss = paddle.mean(paddle.static.nn.fc(x, 1))
        algorithm.distributed_optimizer(paddle.optimizer.SGD(0.1), openks.SyncStrategy()).minimize(
            loss
        )
    with pytest.raises(ConfigError, match="PADDLE_WITH_GLOO=2 FLAGS_LAUNCH_BARRIER=0"):
        algorithm.init_server("somewhere")
    assert not algorithms.hands_over()


def test_a_failing_script_fails_the_launch(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, sys\nsys.exit(4 if os.environ.get('PADDLE_TRAINER_ID') == '1'"
        " and os.environ.get('TRAINING_ROLE') == 'TRAINER' else 0)\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.openks.launch",
            "--worker_num",
            "2",
            "--log_dir",
            str(tmp_path / "logs"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 3
    assert "kspipe-launch: error: worker 1 exited with status 4" in result.stderr
