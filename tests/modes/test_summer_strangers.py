"""Strangers at a shard summer (kspipe/modes/ps/summer.py) and at the job's sockets while
sync rounds go through one: silent, slow, resetting, replaying or flooding, they change no
total and delay no round.  Each summer a real child process, as a server starts it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kspipe.cluster import greetings, secret
from kspipe.cluster.endpoints import free_ports
from kspipe.modes.ps import sharded, summer
from tests.kit.strangers import Eavesdropper, resetting, silent
from tests.kit.summers import Job, a_summer, greeted, round_trip, start_servers
from tests.kit.workers import in_worker_order


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    """The secret the kspipe command hands every process of a job (its summers inherit it)."""
    monkeypatch.setenv(secret.SECRET_ENV, "cd" * 32)


def test_a_stranger_at_a_summers_listener_changes_nothing(summers, capfd):
    """Connections that greet as no worker (garbage, half a greeting, a worker's index
    without the job's secret, an answer of a wrong secret) or as a worker already in are
    closed, one line each; the summer sums as without them."""
    address = a_summer(summers, 3, 1000, 256)
    wrong = secret.answer(
        summer.PURPOSE, "connector", "0", bytes(16), {secret.SECRET_ENV: "ef" * 32}
    )
    for says in (b"garbage!" * 6, b"\x00", bytes(greetings.GREETING_BYTES), bytes(16) + wrong):
        stranger = socket.create_connection(address, timeout=30)
        stranger.sendall(says)
        assert greetings.receive(stranger, secret.NONCE_BYTES)  # the challenge
        stranger.close()
    workers = greeted(address, [1])
    with pytest.raises(OSError):  # after worker 1: turned away (its retries too, till then)
        summer.greet(address, 1, 1.0)
    workers.update(greeted(address, [0, 2]))
    round_trip(workers, 1000)
    for link in workers.values():
        link.close()
    assert summers[0].wait(timeout=30) == 0  # the workers' links closed: the job's end
    err = capfd.readouterr().err
    assert "Traceback" not in err
    refused = [line for line in err.splitlines() if "refused" in line]
    assert len(refused) >= 4 and all(
        line.startswith("kspipe: refused a connection to a shard summer from 127.0.0.1:")
        for line in refused
    ), refused


def slow(address: tuple, count: int) -> list:
    """``count`` connections that say a greeting's length a byte every 0.1 s (a thread)."""
    strangers = silent(address, count)

    def dribble() -> None:
        for _ in range(greetings.GREETING_BYTES):
            for stranger in strangers:
                try:
                    stranger.send(b"\x01")
                except OSError:  # closed: its time was up
                    pass
            time.sleep(0.1)

    threading.Thread(target=dribble, daemon=True).start()
    return strangers


@pytest.mark.parametrize("kind", ["silent", "slow", "resetting"])
def test_strangers_before_the_workers_delay_no_total(summers, capfd, kind):
    """Strangers connected before the workers that say nothing, say it slowly, or reset
    their connections (before, each was waited for in turn, 10 s apiece: 3 silent ones
    delayed a round's first total 30.5 s): the workers' first totals come back within a
    second; a stranger costs one line of the log at most, and no traceback."""
    address = a_summer(summers, 3, 1000)
    strangers = []
    if kind == "resetting":
        resetting(address, 100, b"\x00" * 20)
    else:
        strangers = (silent if kind == "silent" else slow)(address, 3)
    began = time.monotonic()
    workers = greeted(address, range(3))
    round_trip(workers, 1000)
    took = time.monotonic() - began
    for link in [*workers.values(), *strangers]:
        link.close()
    assert took < 1.0, f"the first total came {took:.1f} s after the workers greeted"
    assert summers[0].wait(timeout=30) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert len(err.splitlines()) <= secret.LOGGED_REFUSALS, err


def test_a_stranger_who_keeps_connecting_holds_no_worker_out(summers):
    """A stranger that opens a silent connection every 10 ms from before the workers come
    until after their first round: the workers join and sum within a second."""
    address, stop, strangers = a_summer(summers, 3, 1000), threading.Event(), []

    def keep_connecting() -> None:
        while not stop.is_set() and len(strangers) < 400:
            try:
                strangers.append(socket.create_connection(address, timeout=5))
            except OSError:  # the listener closed once the workers were in
                return
            time.sleep(0.01)

    connecting = threading.Thread(target=keep_connecting, daemon=True)
    connecting.start()
    time.sleep(0.2)
    began = time.monotonic()
    try:
        workers = greeted(address, range(3))
        round_trip(workers, 1000)
        took = time.monotonic() - began
    finally:
        stop.set()
        connecting.join(10)
        for link in strangers:
            link.close()
    for link in workers.values():
        link.close()
    assert took < 1.0, f"the first total came {took:.1f} s after the workers greeted"


def test_a_recorded_greeting_is_refused_by_a_later_summer(summers, capfd):
    """Worker 0's greeting, recorded on its way to one summer, is sent first to another
    summer of the same secret (a later job reusing the secret file): it answers no new
    challenge and is refused; worker 0 still joins."""
    first = a_summer(summers, 1, 100)
    eavesdropper = Eavesdropper(first)
    (link,) = greeted(eavesdropper.address, [0]).values()
    recorded = bytes(eavesdropper.heard[: greetings.GREETING_BYTES])
    link.close()
    eavesdropper.close()
    later = a_summer(summers, 1, 100)
    replay = socket.create_connection(later, timeout=30)
    replay.sendall(recorded)
    assert greetings.receive(replay, secret.NONCE_BYTES)
    assert replay.recv(1) == b""  # refused
    workers = greeted(later, [0])
    round_trip(workers, 100)
    workers[0].close()
    err = capfd.readouterr().err
    assert err.count("kspipe: refused a connection to a shard summer") == 3, err  # 2 probes
    assert err.count("no greeting of the job's") == 1, err


#: A stranger at the job's sockets mid-job, in a process of its own: to every port it is
#: given, some 100 times a second, a connection left open (100 at most) and one reset
#: after half a request.
FLOOD = """
import socket, struct, sys, time
ports, idle = [int(p) for p in sys.argv[1:]], []
while True:
    for port in ports:
        try:
            if len(idle) < 100:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            stranger = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            continue
        stranger.sendall(b"PUT /x" + bytes(54))
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stranger.close()
    time.sleep(0.01)
"""


def test_strangers_mid_job_change_neither_sums_nor_round_times(monkeypatch, tmp_path, summers):
    """Three workers' rounds, half along the chain, half through a summer: strangers that
    hammer the job's gloo book (its own process, as server 0's child) and the chain's and
    summer's ports (closed once every worker is in) change no total, and the rounds' median
    time stays within the run-to-run spread."""
    (port,) = free_ports(1)
    book = subprocess.Popen(
        [sys.executable, "-m", "kspipe.cluster.addresses", str(port), "127.0.0.1", "4"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "book.log", "w"),
    )
    assert book.stdout.readline() == b"ready\n"
    monkeypatch.setenv("PADDLE_GLOO_RENDEZVOUS", "3")
    monkeypatch.setenv("PADDLE_GLOO_HTTP_ENDPOINT", f"127.0.0.1:{port}")
    job, size, rounds, flood = Job(3, 1), 200_000, 24, None
    start_servers(job, size, summers)
    arrays = [np.full(size, 10.0 ** (8 * w)) + np.arange(size) / 3 for w in range(3)]
    expected, times, wrong = in_worker_order(arrays), [], []
    joined = threading.Barrier(3, timeout=30)

    def work(index: int) -> None:
        total = sharded.worker_sum(job.role(index), size)
        for r in range(rounds):
            joined.wait()
            began = time.monotonic()
            result = total.sum(arrays[index])
            if index == 0:
                times.append(time.monotonic() - began)
            if not np.array_equal(result, expected):
                wrong.append((index, r))
            if r == rounds // 2 - 1 and index == 0:  # the strangers come: half the rounds
                nonlocal flood
                summer_port = sharded.look_up(f"127.0.0.1:{port}", sharded.book_key(0))
                ports = [port, int(summer_port), *(p for p in job.values if p)]  # the chain's
                flood = subprocess.Popen([sys.executable, "-c", FLOOD, *map(str, ports)])
                time.sleep(1.0)
        total.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        book.stdin.close()
        book.wait(timeout=10)
    assert not wrong, wrong
    quiet, visited = np.median(times[1 : rounds // 2]), np.median(times[rounds // 2 :])
    assert visited < 2 * quiet + 0.02, (
        f"rounds took {visited * 1e3:.1f} ms, {quiet * 1e3:.1f} before"
    )
    log = (tmp_path / "book.log").read_text()
    assert "Traceback" not in log and 0 < len(log.splitlines()) <= secret.LOGGED_REFUSALS
