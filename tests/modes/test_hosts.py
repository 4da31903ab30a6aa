"""A parameter-server job across two "hosts": loopback aliases 127.0.0.2 and 127.0.0.3 are
separate addresses on one machine.  One launcher per host, as a user runs on two machines,
with the endpoint lists in Hydra's list syntax, as docs/distributed.md shows."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kspipe.testing import run_statuses, tiny_overrides
from tests.kit import job_processes

HOST_A, HOST_B, HOST_C = "127.0.0.2", "127.0.0.3", "127.0.0.4"
#: The job's secret, the same on every host (kspipe.cluster.secret)
SECRET = "3c" * 32


def free_base(span: int = 8) -> int:
    """A port p with p .. p + span free on both hosts."""
    for _ in range(50):
        s = socket.socket()
        s.bind((HOST_A, 0))
        base = s.getsockname()[1]
        s.close()
        if base + span < 65535 and all(
            free(h, base + i) for h in (HOST_A, HOST_B, HOST_C) for i in range(span)
        ):
            return base
    raise RuntimeError("no free port range")


def free(host, port) -> bool:
    s = socket.socket()
    try:
        s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def launch(tmp_path, data, host, base, *extra, servers=(HOST_A,)):
    args = [
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, data),
        f"run_dir={tmp_path / host}",
        "mode=pserver",
        "cluster.strategy=sync",
        f"servers=[{','.join(f'{h}:{base}' for h in servers)}]",
        f"workers=[{HOST_A}:{base + 3},{HOST_B}:{base + 6}]",
        f"cluster.host={host}",
        "cluster.timeout_s=300",
        *extra,
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "kspipe.cli.command", *args],
        cwd=tmp_path,
        env=dict(os.environ, KSPIPE_JOB_SECRET=SECRET),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_hosts_finish_with_one_run(tmp_path, tiny_data):
    base = free_base()
    a = launch(tmp_path, tiny_data, HOST_A, base)
    b = launch(tmp_path, tiny_data, HOST_B, base)
    out_a, err_a = a.communicate(timeout=300)
    out_b, err_b = b.communicate(timeout=60)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    assert "kspipe: done: test_accuracy" in out_a
    assert f"{HOST_A} (worker 0's host) records the run" in err_b
    assert "this host's part" in out_b
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
    assert (tmp_path / HOST_B / "logs" / "worker.1.log").exists()
    assert "meta-train" in (tmp_path / HOST_B / "logs" / "worker.1.log").read_text()
    assert not job_processes(tmp_path)
    assert not holding(tmp_path, SECRET.encode())  # not in params, artifacts or logs


def holding(folder, text: bytes) -> list:
    """The files under ``folder`` that hold ``text``."""
    return [p for p in folder.rglob("*") if p.is_file() and text in p.read_bytes()]


def worker_pid(tmp_path, index):
    for pid in job_processes(tmp_path):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"TRAINING_ROLE=TRAINER" in env and f"PADDLE_TRAINER_ID={index}".encode() in env:
            return pid
    return None


@pytest.mark.parametrize("kill", ["launcher", "worker", "worker, a host of servers"])
def test_a_failure_on_one_host_stops_the_other(tmp_path, tiny_data, kill):
    """A failure stops every host, each launcher exits non-zero and names it: with a third
    host that serves and trains nothing too, whose servers end as the job ends."""
    base = free_base()
    long = ["train.meta_iters=100000", "train.checkpoint_every=0", "eval.interval=0"]
    servers = (HOST_A, HOST_C) if "servers" in kill else (HOST_A,)
    a = launch(tmp_path, tiny_data, HOST_A, base, *long, servers=servers)
    b = launch(tmp_path, tiny_data, HOST_B, base, *long, servers=servers)
    c = (
        launch(tmp_path, tiny_data, HOST_C, base, *long, servers=servers)
        if "servers" in kill
        else None
    )
    try:
        log = tmp_path / HOST_B / "logs" / "worker.1.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and "meta-train" in log.read_text(errors="replace")):
            assert time.monotonic() < deadline and a.poll() is None and b.poll() is None
            time.sleep(0.5)
        if kill == "launcher":
            b.kill()  # SIGKILL: no word to the other host
        else:
            os.kill(worker_pid(tmp_path, 1), signal.SIGKILL)
        killed = time.monotonic()
        _, err_a = a.communicate(timeout=90)
        took = time.monotonic() - killed
        _, err_b = b.communicate(timeout=30)
        err_c = c.communicate(timeout=30)[1] if c else None
    finally:
        for p in (a, b, c):
            if p is not None and p.poll() is None:
                p.kill()
    assert a.returncode != 0 and b.returncode != 0
    if c is not None:  # named once, by the host where it began
        assert c.returncode != 0, err_c
        assert f"the job failed on {HOST_B}: worker 1 was killed by SIGKILL" in err_c, err_c
        assert err_c.count("the job failed on") == 1, err_c
    assert took < 60, took
    assert "Traceback" not in err_a and "Traceback" not in err_b
    if kill == "launcher":
        assert f"the launcher on {HOST_B} went away" in err_a
    else:
        assert "worker 1 was killed by SIGKILL" in err_b
        assert f"the job failed on {HOST_B}: worker 1 was killed by SIGKILL" in err_a
    time.sleep(1)
    assert not job_processes(tmp_path)
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
