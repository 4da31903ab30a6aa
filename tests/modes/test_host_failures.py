"""A host of a job across hosts that loses power or is cut off sends nothing, not even a FIN:
its launchers say ``alive`` every quarter of ``cluster.peer_timeout``
(kspipe/launchers/hosts.py), and a host not heard from for that long fails the job in one
line, on every side, instead of leaving it to the stall watch (600 s) or to nothing at all.

* two control links in this process on loopback, one of which stops saying anything;
* two emulated hosts (tests.kit.network) running a job, the second's cable pulled.

Hosts that share a run folder restart each in its own time: each moves its own processes'
logs and clears its own progress files, never another host's.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kspipe.cluster import secret
from kspipe.cluster.endpoints import free_ports
from kspipe.launchers import stalls
from kspipe.launchers.hosts import HostLink, JobHosts
from kspipe.launchers.restarts import keep_logs
from kspipe.testing import begun_store, run_statuses
from tests.kit.network import Network, unavailable

FIRST, OTHER = "127.0.0.1", "127.0.0.2"


def linked(peer_timeout: float) -> tuple[HostLink, HostLink]:
    (port,) = free_ports(1)
    everyone = frozenset({FIRST, OTHER})
    first = HostLink(JobHosts(FIRST, FIRST, everyone, (FIRST, port)), 60, peer_timeout)
    other = HostLink(JobHosts(OTHER, FIRST, everyone, (FIRST, port)), 60, peer_timeout)
    first.open(lambda line: None)
    other.open(lambda line: None)
    deadline = time.monotonic() + 10
    while OTHER not in first._peers:
        assert time.monotonic() < deadline, "the hosts did not meet"
        time.sleep(0.02)
    return first, other


@pytest.mark.parametrize("silent", ["other", "first"])
def test_a_host_that_falls_silent_is_lost_within_the_peer_timeout(monkeypatch, silent):
    monkeypatch.setenv(secret.SECRET_ENV, "5c" * 32)
    first, other = linked(peer_timeout=1.0)
    quiet, watching = (other, first) if silent == "other" else (first, other)
    try:
        time.sleep(2.0)  # healthy links say alive: nothing is lost
        assert first.failure() is None and other.failure() is None
        monkeypatch.setattr(quiet, "_send", lambda message: None)  # the cable is pulled
        started = time.monotonic()
        while watching.failure() is None:
            assert time.monotonic() - started < 3.0, "the silent host was never found"
            time.sleep(0.05)
        lost = quiet.hosts.here
        assert watching.failure() == (
            f"the launcher on {lost} was not heard from for cluster.peer_timeout=1 s "
            f"(its machine was lost or cut off)"
        )
        # its last word came up to a quarter of the timeout before the cable was pulled
        assert time.monotonic() - started > 0.7
    finally:
        first.close()
        other.close()


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_host_cut_off_mid_job_fails_the_job_in_one_line(bags_env, tmp_path):
    """h1: the server and worker 0; h2: worker 1.  Once both train, h2's cable is pulled:
    h1's launcher ends within the peer timeout and a few seconds, its one line naming h2,
    the run FAILED; h2's launcher ends too, naming h1; the stall watch is off."""
    kspipe = str(Path(sys.executable).with_name("kspipe"))
    peer_timeout = 4
    with Network(hosts=2, mbit=1000, names=False) as network:
        h1, h2 = network.hosts
        launchers, errs = {}, {}
        for host in (h1, h2):
            errs[host.name] = tmp_path / f"{host.name}.err"
            with open(errs[host.name], "w") as err:
                launchers[host.name] = host.popen(
                    [
                        kspipe,
                        "+experiment=bags",
                        "bags.epochs=400",
                        "mode=pserver",
                        "cluster.strategy=sync",
                        f"servers=[{h1.address}:6000]",
                        f"workers=[{h1.address}:6100,{h2.address}:6100]",
                        f"cluster.host={host.address}",
                        f"cluster.peer_timeout={peer_timeout}",
                        "cluster.stall_seconds=null",
                        f"tracking.uri={begun_store(tmp_path)}",
                        f"run_dir={tmp_path / host.name}",
                    ],
                    cwd=tmp_path,
                    env=dict(bags_env, KSPIPE_JOB_SECRET="3e" * 32),
                    stdout=err,
                    stderr=err,
                )
        training = tmp_path / "h2" / "logs" / "worker.1.log"
        deadline = time.monotonic() + 180
        while "train" not in (training.read_text() if training.exists() else ""):
            assert time.monotonic() < deadline and all(
                p.poll() is None for p in launchers.values()
            ), {n: e.read_text()[-2000:] for n, e in errs.items()}
            time.sleep(0.2)
        time.sleep(1.0)
        network.cut(h2)
        cut = time.monotonic()
        for launcher in launchers.values():
            launcher.wait(timeout=peer_timeout + 30)
        ended = time.monotonic() - cut
    out = {name: err.read_text() for name, err in errs.items()}
    assert ended < peer_timeout + 20, out
    for name, launcher in launchers.items():
        assert launcher.returncode not in (0, None), out[name][-3000:]
    errors = [line for line in out["h1"].splitlines() if line.startswith("kspipe: error:")]
    assert len(errors) == 1, out["h1"][-3000:]
    assert f"the launcher on {h2.address} was not heard from" in errors[0]
    assert "Traceback" not in out["h1"] and "Traceback" not in out["h2"]
    assert f"the launcher on {h1.address} was not heard from" in out["h2"]
    assert run_statuses(tmp_path / "mlflow.db") == ["FAILED"]


def test_hosts_sharing_a_run_folder_keep_their_own_logs_apart(tmp_path):
    """Three hosts' launchers restart at once in one shared run folder, 20 times over: each
    moves its own processes' logs into logs/attempt-<n> (none raises, none moves another
    host's) and clears its own progress files alone."""
    processes = {host: [("worker", host), ("server", host)] for host in range(3)}
    for attempt in range(1, 21):
        logs = tmp_path / f"run-{attempt}" / "logs"
        logs.mkdir(parents=True)
        for own in processes.values():
            for role, index in own:
                (logs / f"{role}.{index}.log").write_text(f"{role} {index}")
                (logs / f"{role}.{index}.progress").write_text("{}")
        errors = []

        def restart(own, logs=logs, attempt=attempt, errors=errors):
            try:
                keep_logs(str(logs), attempt, [f"{role}.{index}.log" for role, index in own])
            except Exception as err:  # what a launcher would crash with
                errors.append(err)

        restart(processes[0])  # the first to restart leaves the others' logs where they are
        assert sorted(p.name for p in logs.glob("*.log")) == [
            "server.1.log",
            "server.2.log",
            "worker.1.log",
            "worker.2.log",
        ]
        threads = [threading.Thread(target=restart, args=(processes[h],)) for h in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        kept = sorted(p.name for p in (logs / f"attempt-{attempt}").iterdir())
        assert kept == sorted(f"{r}.{i}.log" for own in processes.values() for r, i in own)
        stalls.clear(str(logs), processes[0])
        assert sorted(p.name for p in logs.glob("*.progress")) == [
            "server.1.progress",
            "server.2.progress",
            "worker.1.progress",
            "worker.2.progress",
        ]
