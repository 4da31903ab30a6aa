"""The sync rounds' sum shared between the workers' chain and shard summers beside the
servers (kspipe/modes/ps/sharded.py, kspipe/modes/ps/summer.py), on loopback: workers are
threads of this process, each server's summer a real child process, announced through a
real address book: exactly the sum in worker order, strangers kept out, and a worker that
leaves fails every other worker's round."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kspipe.cluster import greetings, secret
from kspipe.cluster.addresses import AddressBook
from kspipe.cluster.endpoints import free_ports
from kspipe.errors import ClusterError
from kspipe.modes import summing
from kspipe.modes.ps import sharded, summer
from tests.kit.strangers import Eavesdropper, resetting, silent
from tests.kit.workers import Workers, in_worker_order


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    """The secret the kspipe command hands every process of a job (its summers inherit it)."""
    monkeypatch.setenv(secret.SECRET_ENV, "cd" * 32)


class Job(Workers):
    """``count`` workers' and ``servers`` servers' roles; the job's address book."""

    def __init__(self, count: int, servers: int):
        super().__init__(count)
        self.servers = [f"127.0.0.1:{8000 + s}" for s in range(servers)]

    def role(self, index: int, server: int = -1):
        role = super().role(index)
        role.get_pserver_endpoints = lambda: list(self.servers)
        role.server_index = lambda: server
        role.worker_num = lambda: self.count
        return role


@pytest.fixture
def book(monkeypatch):
    """The job's address book on loopback, named in the environment as Paddle's contract
    names it."""
    book = AddressBook(0, "127.0.0.1")
    threading.Thread(target=book.serve_forever, daemon=True).start()
    monkeypatch.setenv("PADDLE_GLOO_RENDEZVOUS", "3")
    monkeypatch.setenv("PADDLE_GLOO_HTTP_ENDPOINT", f"127.0.0.1:{book.server_address[1]}")
    yield book
    book.shutdown()
    book.server_close()


@pytest.fixture
def summers():
    """The summers started in a test; each ends as its server would (stdin closed)."""
    started: list = []
    yield started
    for process in started:
        if process is not None:
            process.stdin.close()
            process.wait(timeout=30)


def start_servers(job: Job, size: int, summers: list, dtype="float64", chunk_bytes=None):
    for s in range(len(job.servers)):
        kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        summers.append(sharded.start_summer(job.role(-1, s), size, dtype, **kwargs))


def run_workers(job: Job, rounds: list, dtype="float64") -> list:
    """Each worker's result of each round (``rounds[r][w]``: worker w's array in round r)."""
    results = [[None] * len(rounds) for _ in range(job.count)]
    errors: list = []

    def work(index: int) -> None:
        try:
            total = sharded.worker_sum(job.role(index), rounds[0][0].size, dtype=dtype)
            assert isinstance(total, sharded.ShardedSum)
            for r, arrays in enumerate(rounds):
                results[index][r] = total.sum(arrays[index])
            total.close()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(job.count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def test_the_split_lowers_the_busiest_links_bytes_from_three_workers():
    """The chain's share f balances a middle worker's link, (1 + f) W, with a server's,
    N (1 - f) W / M; two workers keep the chain alone."""
    assert sharded.chain_fraction(2, 1) == sharded.chain_fraction(1, 1) == 1.0
    assert sharded.chain_fraction(16, 8) == pytest.approx(1 / 3)
    assert sharded.chain_fraction(3, 8) == 0.0  # more servers than workers: all on them
    for workers, servers in [(3, 1), (3, 2), (16, 8), (16, 4), (5, 7)]:
        f = sharded.chain_fraction(workers, servers)
        middle, server = 1 + f, workers * (1 - f) / servers
        assert max(middle, server) < 2.0  # the chain alone: 2 W
        assert middle == pytest.approx(server) or f == 0.0
    chain_end, slices = sharded.split(1003, 16, 8)
    assert chain_end == 334 and slices[0] == (334, 418) and slices[-1] == (920, 1003)
    assert [end - start for start, end in slices] == [84] * 5 + [83] * 3
    assert sharded.split(10, 2, 1) == (10, [(10, 10)])


@pytest.mark.parametrize(
    "count,servers,dtype,chunk_bytes",
    [
        (3, 1, "float64", 1 << 15),  # the chain's share 1/2, one summer
        (3, 2, "float64", 64),  # many chunks, a short last one
        (5, 2, "float32", 8),  # a value a chunk; a collective's dtype
        (4, 8, "float64", 1000),  # more servers than workers: no chain, all on summers
    ],
)
def test_the_split_sums_in_worker_order_bit_for_bit(
    monkeypatch, book, summers, count, servers, dtype, chunk_bytes
):
    """Values of very different magnitudes, so that another order of addition gives other
    bits; the chain's chunks and the summers' of several sizes; two rounds of different
    arrays; every worker gets the sum in worker order, in the arrays' dtype."""
    monkeypatch.setattr(summing, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(count * 10 + servers)
    rounds = [
        [
            (rng.standard_normal((37, 11)) * 10.0 ** rng.integers(-8, 8)).astype(dtype)
            for _ in range(count)
        ]
        for _ in range(2)
    ]
    job = Job(count, servers)
    start_servers(job, rounds[0][0].size, summers, dtype, chunk_bytes)
    assert sum(process is not None for process in summers) == servers
    results = run_workers(job, rounds, dtype)
    for r, arrays in enumerate(rounds):
        expected = in_worker_order(arrays)
        assert not np.array_equal(expected, in_worker_order(arrays[::-1]))  # order shows
        for w in range(count):
            assert results[w][r].dtype == dtype and results[w][r].shape == (37, 11)
            np.testing.assert_array_equal(results[w][r], expected, err_msg=f"{w} {r}")


def test_two_workers_or_no_address_book_keep_the_chain_alone(monkeypatch, book, summers):
    job = Job(2, 1)
    start_servers(job, 100, summers)
    assert summers == [None]
    assert sharded.splits(Job(3, 1).role(0), 100)
    monkeypatch.setenv("PADDLE_GLOO_RENDEZVOUS", "2")  # a folder: nowhere to announce
    assert not sharded.splits(Job(3, 1).role(0), 100)


def a_summer(summers: list, workers: int, size: int, chunk_bytes: int = summer.CHUNK_BYTES):
    """A summer started as a server starts it (in ``summers``); its listener's address, once
    it greets (a connection that goes away at once: one line in its log)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    address = listener.getsockname()
    summers.append(summer.launch(listener, workers, size, "float64", chunk_bytes))
    with socket.create_connection(address, timeout=60) as probe:
        greetings.receive(probe, secret.NONCE_BYTES)
    return address


def greeted(address: tuple, workers, timeout_s: float = 30.0) -> dict:
    """Each of ``workers`` greeting the summer at ``address`` at once (a thread each), as
    each worker's process does: their links."""
    links: dict = {}

    def greet(w: int) -> None:
        links[w] = summer.greet(address, w, timeout_s)
        links[w].settimeout(timeout_s)

    threads = [threading.Thread(target=greet, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return links


def round_trip(links: dict, size: int) -> np.ndarray:
    """One round: each worker's slice sent, each worker's totals received and checked."""
    arrays = [np.full(size, 10.0 ** (8 * w)) + np.arange(size) / 3 for w in range(len(links))]
    for w in sorted(links):  # each worker's slice; the totals wait in each link
        links[w].sendall(arrays[w].tobytes())
    for w in sorted(links):
        total = np.empty(size)
        summing.receive_into(links[w], total)
        np.testing.assert_array_equal(total, in_worker_order(arrays))


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


def test_a_worker_slow_to_take_its_totals_holds_back_no_other(summers):
    """Worker 1 of 3 sends its slice and takes none of its totals (its link busy with
    other flows, on a cluster): workers 0 and 2 still get every total, though theirs and
    worker 1's are far more than the links' buffers hold."""
    size = 8_000_000  # 64 MB a worker's totals: many times a loopback link's buffers
    links = greeted(a_summer(summers, 3, size), range(3), timeout_s=60)
    arrays = [np.full(size, float(w + 1)) + np.arange(size) / 7 for w in range(3)]
    sending = [
        threading.Thread(target=links[w].sendall, args=(arrays[w].tobytes(),), daemon=True)
        for w in range(3)
    ]  # each on a thread: the summer reads the workers' slices a chunk at a time, in turn
    for thread in sending:
        thread.start()
    expected = in_worker_order(arrays)
    for w in (0, 2):
        total = np.empty(size)
        summing.receive_into(links[w], total)  # the links' timeout: 60 s
        np.testing.assert_array_equal(total, expected)
    for link in links.values():
        link.close()
    assert summers[0].wait(timeout=30) == 0


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


@pytest.mark.parametrize("leaves", ["at once", "after its slices", "the server ends"])
def test_a_worker_that_leaves_mid_round_fails_the_round_of_every_other(book, summers, leaves):
    """Worker 2 of 3 (one summer: half the array on the chain) leaves after joining, at
    once or after sending its slice; or server 0 ends: the others' round fails with an
    error, none waits for ever, and the summer ends."""
    job, errors, size = Job(3, 1), {}, 100_000
    start_servers(job, size, summers)
    joined = threading.Barrier(3, timeout=30)

    def work(index: int) -> None:
        total = sharded.worker_sum(job.role(index), size)
        joined.wait()
        try:
            if index == 2 and leaves != "the server ends":
                if leaves == "after its slices":
                    for _, link, start, end in total.links:
                        link.sendall(np.ones(end - start).tobytes())
                total.close()
                return
            if index == 0 and leaves == "the server ends":
                summers[0].stdin.close()
            total.sum(np.ones(size))
        except Exception as err:  # noqa: BLE001 - what each worker saw
            errors[index] = err

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a worker still waits"
    assert set(errors) == ({0, 1, 2} if leaves == "the server ends" else {0, 1})
    assert all(isinstance(e, (ClusterError, OSError)) for e in errors.values()), errors
    summers[0].wait(timeout=30)
